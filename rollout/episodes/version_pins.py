"""Version pins: a multi-turn episode finishes on the weights it started with.

A multi-turn episode is several engine calls (one per turn) with the environment in between; a
weight push that lands between two of them would make the trajectory's turns come from two
policies. The engine actor therefore keeps a table of pins (docs/design/version-clock.md#version-clock):

* an episode batch opens a pin at the version the engine serves (:meth:`VersionPins.open`) before
  its first turn and releases it after its last (:meth:`VersionPins.release`);
* a weight load of a newer version holds the table exclusively (:meth:`VersionPins.exclusive`):
  it waits until no pin of an older version is held, and while it waits (or loads) no new pin
  opens (:meth:`VersionPins.no_load`), so the episodes already running finish at their version
  and the load cannot be starved by episodes that start later;
* loads keep their arrival order (one lock, first come first served).

A pin whose holder stops coming back (a paused generation gate, a manager that died) must not
hold a push forever: it lapses once the engine has served no request for ``lease_s`` seconds
and its holder has not used it for as long (engine time spent serving other requests never
counts against a pin). A lapsed pin's episode may then see the new version; the rollout manager
generates such an episode batch again, whole, at the new version and counts it.

Everything runs in one event loop (the engine actor's); not thread-safe. A table without pins
never suspends: the load path of a single-turn run is exactly what it was without pins.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from replayrl.rollout.errors import EngineInputError

__all__ = ["VersionPins"]

log = logging.getLogger(__name__)


@dataclass
class _Pin:
    version: int
    last_used: float  # time.monotonic() of the holder's last request


class VersionPins:
    """The pins of one engine actor (see the module docstring).

    Args:
        lease_s: seconds, ``> 0``: a pin lapses after this long without a request from its
            holder while the engine served nothing either.
    Raises:
        EngineInputError: ``lease_s`` not a positive number.
    """

    def __init__(self, lease_s: float) -> None:
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not lease_s > 0:
            raise EngineInputError(f"pin lease_s must be a number > 0, got {lease_s!r}")
        self.lease_s = float(lease_s)
        self.lapsed = 0  # pins dropped because their lease ran out, over the actor's life
        self._pins: dict[str, _Pin] = {}
        self._changed = asyncio.Event()  # set (and renewed) when a pin goes away
        self._loads = 0  # loads waiting for the table or loading now
        self._no_load = asyncio.Event()
        self._no_load.set()
        self._lock = asyncio.Lock()  # FIFO: loads land in arrival order
        self._served_at = time.monotonic()

    def held(self) -> dict[str, int]:
        """``{pin id: version}`` of the pins held now."""
        return {pin: p.version for pin, p in self._pins.items()}

    def open(self, pin: str, version: int) -> None:
        """Register ``pin`` at ``version`` (the engine's version now; no load may be pending:
        await :meth:`no_load` first).

        Raises:
            EngineInputError: ``pin`` is not a non-empty str, or is already held.
        """
        if not isinstance(pin, str) or not pin:
            raise EngineInputError(f"pin must be a non-empty str, got {pin!r}")
        if pin in self._pins:
            raise EngineInputError(f"pin {pin!r} is already held (at version "
                                   f"{self._pins[pin].version})")
        self._pins[pin] = _Pin(int(version), time.monotonic())

    def touch(self, pin: str | None) -> int | None:
        """A request of ``pin``'s holder is being served: renew its lease and the engine's.

        Returns:
            the pin's version, or ``None`` when ``pin`` is ``None``, was never opened or lapsed.
        """
        now = time.monotonic()
        self._served_at = now
        held = self._pins.get(pin) if pin is not None else None
        if held is None:
            return None
        held.last_used = now
        return held.version

    def served(self) -> None:
        """The engine finished serving a request (any): no pin lapses while the engine works."""
        self._served_at = time.monotonic()

    def release(self, pin: str) -> bool:
        """Drop ``pin`` (idempotent); returns whether it was held."""
        if self._pins.pop(pin, None) is None:
            return False
        self._signal()
        return True

    async def no_load(self) -> None:
        """Return once no load is waiting for the table or loading (at once when none is)."""
        while self._loads:
            await self._no_load.wait()

    @contextlib.asynccontextmanager
    async def exclusive(self, version: int) -> AsyncIterator[None]:
        """Hold the table for a load of ``version``: wait for earlier loads, then until no pin
        of a version below ``version`` is held (lapsing idle ones); no pin opens meanwhile.

        With no pin held and no other load, nothing in here suspends.
        """
        self._loads += 1
        self._no_load.clear()
        try:
            async with self._lock:
                while True:
                    now = time.monotonic()
                    older = {pin: p for pin, p in self._pins.items() if p.version < version}
                    if not older:
                        break
                    left = min(max(p.last_used, self._served_at) + self.lease_s - now
                               for p in older.values())
                    if left <= 0:
                        self._lapse(older, now, version)
                        continue
                    changed = self._changed
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(changed.wait(), left)
                yield
        finally:
            self._loads -= 1
            if self._loads == 0:
                self._no_load.set()

    def _lapse(self, older: dict[str, _Pin], now: float, version: int) -> None:
        """Drop the pins among ``older`` whose lease ran out."""
        for pin, p in older.items():
            if max(p.last_used, self._served_at) + self.lease_s <= now:
                del self._pins[pin]
                self.lapsed += 1
                log.warning("version pin %s (version %d) lapsed after %.1f s unused; loading "
                            "version %d", pin, p.version, self.lease_s, version)

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
