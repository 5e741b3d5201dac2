"""The pause / resume point of the rollout side (docs/design/multi-host.md#attach-and-multi-host).

Every engine request of the RolloutManager (one per turn of a prompt chunk: generation, exact
refill and evaluation alike) passes :meth:`GenerationGate.request` before it is sent. Closing the
gate holds new requests where they are; requests already at an engine finish normally. Nothing
else changes: the weight version a request is served at is still the engine's at that moment,
pushes happen only where the loop makes them, so a paused and resumed rollout carries the same
versions a never-paused one would (the clock's window is checked as always).
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

__all__ = ["GenerationGate"]


class GenerationGate:
    """An open / closed gate in front of the engine requests, with a count of those in flight.

    Used inside one event loop (the manager actor's); not thread-safe.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._held = 0

    @property
    def paused(self) -> bool:
        """True while the gate is closed."""
        return not self._open.is_set()

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Wait while paused, then count one engine request in flight for the block's duration."""
        if not self._open.is_set():
            self._held += 1
            try:
                await self._open.wait()
            finally:
                self._held -= 1
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def pause(self) -> None:
        """Close the gate: requests not yet sent wait; those in flight go on."""
        self._open.clear()

    def resume(self) -> None:
        """Open the gate: every held request goes on."""
        self._open.set()

    async def drained(self) -> None:
        """Return once no request is in flight (at once when none is)."""
        await self._idle.wait()

    def state(self) -> dict:
        """``{"paused": bool, "in_flight": int, "held": int}``: the gate, the engine requests
        being served now and those waiting at the closed gate."""
        return {"paused": self.paused, "in_flight": self._in_flight, "held": self._held}
