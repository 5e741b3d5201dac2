"""The rollout engines a RolloutManager dispatches prompt groups to, and what a lost one costs.

An engine is lost when a call to it fails with :class:`replayrl.actors.errors.PeerLost`: its process
exited, or it stayed silent past the run's heartbeat deadline (``--heartbeat-deadline-s``).
The reply of that call never comes, so the prompt groups it carried are unfinished and none of
their trajectories exist anywhere yet. ``--engine-failure`` decides what happens
(docs/design/engine-faults.md#engine-faults):

- ``regenerate``: the engine leaves the pool for good; its unfinished groups run again, whole
  and with the same seed, on a remaining engine. With none left the rollout fails.
- ``restart``: the same, but the launcher starts a new process in its place; it rejoins the
  pool (:meth:`EnginePool.restore`) only after it loaded the trainer's current weights. With
  no engine in the pool the groups wait for a restored one.
- ``fail``: the ``PeerLost`` propagates and ends the run (the behaviour before fault
  tolerance).

A regenerated group keeps its group id, its place in the batch and its prompts, so the step
trains on exactly the groups it would have; its samples carry the version of the engine that
served them, which the VersionClock checks like any other.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, TypeVar

from replayrl.actors.errors import PeerLost
from replayrl.rollout.errors import EnginesLost

log = logging.getLogger(__name__)
T = TypeVar("T")

ENGINE_FAILURE_POLICIES = ("regenerate", "restart", "fail")
"""``--engine-failure`` values (see the module docstring)."""


class EnginePool:
    """Which of the run's engines serve, and the rerun of work an engine lost.

    Args:
        engines: the run's engine actor names, in order.
        policy: one of :data:`ENGINE_FAILURE_POLICIES`.
        restore_timeout_s: under ``restart``, the longest a rerun waits for an engine to
            rejoin when none is in the pool; seconds.
    Raises:
        ValueError: no engine, or an unknown policy.
    """

    def __init__(self, engines: list[str], policy: str, restore_timeout_s: float) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        if policy not in ENGINE_FAILURE_POLICIES:
            raise ValueError(f"--engine-failure must be one of {ENGINE_FAILURE_POLICIES}, "
                             f"got {policy!r}")
        self.engines = list(engines)
        self.policy = policy
        self.restore_timeout_s = restore_timeout_s
        self.lost: dict[str, str] = {}  # engine -> why it left the pool
        self.losses = 0  # engines lost over the run (a restarted one can be lost again)
        self._turn = 0
        self._restored = asyncio.Event()

    def live(self) -> list[str]:
        """The engines in the pool now, in run order."""
        return [e for e in self.engines if e not in self.lost]

    def lose(self, engine: str, why: str) -> None:
        """Take ``engine`` out of the pool (idempotent)."""
        if engine not in self.lost:
            self.lost[engine] = why
            self.losses += 1
            log.warning("engine %s lost (%s); %d of %d left; policy %s", engine, why,
                        len(self.live()), len(self.engines), self.policy)

    def restore(self, engine: str) -> None:
        """Put a restarted ``engine`` back into the pool (it serves the current weights).

        Raises:
            ValueError: ``engine`` is not one of the run's engines.
        """
        if engine not in self.engines:
            raise ValueError(f"unknown engine {engine!r}; the run's engines: {self.engines}")
        if self.lost.pop(engine, None) is not None:
            log.warning("engine %s restored; %d of %d in the pool", engine, len(self.live()),
                        len(self.engines))
            self._restored.set()
            self._restored = asyncio.Event()

    async def _another(self) -> str:
        """A live engine, in turn; under ``restart`` waits for one when none is live.

        Raises:
            EnginesLost: none live (``regenerate``), or none restored within
                ``restore_timeout_s`` (``restart``).
        """
        deadline = asyncio.get_running_loop().time() + self.restore_timeout_s
        while not (live := self.live()):
            left = deadline - asyncio.get_running_loop().time()
            if self.policy != "restart" or left <= 0:
                raise EnginesLost(f"no engine left to serve the rollout: {self.lost}")
            try:
                await asyncio.wait_for(self._restored.wait(), left)
            except asyncio.TimeoutError:
                pass
        self._turn += 1
        return live[self._turn % len(live)]

    async def run(self, engine: str, work: Callable[[str], Awaitable[T]]) -> tuple[T, int]:
        """``await work(engine)``; when the engine is (or gets) lost, again on another one.

        ``work`` must be safe to repeat from scratch: its result is whole or absent (one
        engine call's reply per turn, kept only when every turn came back).

        Returns:
            ``(result, reruns)``: ``reruns`` counts the times the work was started again
            because its engine was lost.
        Raises:
            replayrl.actors.errors.PeerLost: an engine was lost under ``fail``.
            EnginesLost: as :meth:`_another`.
            Whatever ``work`` raises otherwise.
        """
        reruns = 0
        while True:
            if engine in self.lost:
                engine = await self._another()
            try:
                return await work(engine), reruns
            except PeerLost as exc:
                if self.policy == "fail":
                    raise
                self.lose(engine, str(exc))
                reruns += 1
