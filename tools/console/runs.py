"""The run a REPL session serves: its own actor processes, or a run it attached to
(docs/design/multi-host.md#attach-and-multi-host).

Each is served by :class:`replayrl.tools.console.actor_loop.ActorLoop` through ``serve(ready,
stopped)`` and guards the console's calls with ``guard(coro)``.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine

from replayrl.actors import ActorError, ActorSpec, Directory, Supervisor
from replayrl.actors.run_dir import create_run_dir
from replayrl.tools.errors import SessionClosed
from replayrl.tools.run.attach_card import AttachTarget, resolve_attach
from replayrl.tools.run.config import RunConfig

__all__ = ["MANAGER", "CLOCK", "OwnRun", "AttachedRun"]

log = logging.getLogger(__name__)

MANAGER = "rollout_manager"
"""The actor whose gate pauses generation (``RolloutManager.pause_generation``)."""
CLOCK = "version_clock"


class OwnRun:
    """The actor processes a session starts, watches and stops, under a
    :class:`replayrl.actors.Supervisor`.

    Construction creates the run's ipc directory (a short path: the AF_UNIX limit; stale ones
    are removed) and its :class:`replayrl.actors.Directory`; :meth:`serve` starts every actor
    and waits until each answers ``__ping__``, then stops them all (polite ``__stop__``, then
    SIGTERM / SIGKILL) when told to; :meth:`remove_run_dir` removes the ipc directory.

    Args:
        config: the run's configuration (``transport``, ``curve_keys``, ``output_dir``).
        specs: one spec per actor.
        ready_timeout: seconds every actor gets to answer its first ping.
        log_level: logging level inside the actor processes.
    """

    paused_here = False  # the actors stop on leaving: nothing to resume

    def __init__(self, config: RunConfig, specs: list[ActorSpec], *, ready_timeout: float,
                 log_level: int) -> None:
        self.config = config
        self.specs = list(specs)
        self.ready_timeout = ready_timeout
        self.log_level = log_level
        self.supervisor: Supervisor | None = None
        self._watch: asyncio.Future | None = None
        self.run_dir: Path | None = create_run_dir()
        self.directory: Directory | None = Directory.for_run(
            self.run_dir, [s.name for s in self.specs], config.transport,
            curve_keys=config.curve_keys)

    async def serve(self, ready: Callable[[], None], stopped: Callable[[], Awaitable[Any]]) -> None:
        """Run the supervisor: start the actors, call ``ready()``, watch them until
        ``stopped()`` returns, then stop them.

        Raises:
            replayrl.actors.ActorDied: an actor process exited while starting.
            replayrl.actors.ActorError: an actor did not answer within ``ready_timeout`` seconds.
        """
        supervisor = Supervisor(self.specs, self.directory, self.run_dir,
                                ready_timeout=self.ready_timeout, log_level=self.log_level,
                                run_name=str(self.config.output_dir))
        self.supervisor = supervisor
        async with supervisor:
            self._watch = asyncio.ensure_future(supervisor.watch())
            self._watch.add_done_callback(_consume_exception)
            ready()
            try:
                await stopped()
            finally:
                self._watch.cancel()
                await asyncio.gather(self._watch, return_exceptions=True)

    async def guard(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await ``coro`` racing the supervisor's watch, so an actor process that dies ends the
        wait with :class:`replayrl.actors.ActorDied` instead of a timeout.

        Raises:
            replayrl.actors.ActorDied: an actor process of the run exited (during the call, or
                the call's failure is explained by one that did).
            replayrl.tools.errors.SessionClosed: the watch ended without a dead actor
                (the session is closing).
            whatever ``coro`` raises.
        """
        task = asyncio.ensure_future(coro)
        watch = self._watch
        if watch is None:
            return await task
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if task in done:
            if task.exception() is not None and self.supervisor is not None:
                raise await self.supervisor.explain(task.exception())
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        dead = self.supervisor.died() if self.supervisor is not None else None
        if dead is not None:
            raise dead
        raise SessionClosed("the actor supervisor stopped watching; the session is closing")

    @property
    def processes(self) -> dict[str, Any]:
        """The supervisor's process objects (:class:`replayrl.actors.child_process.ChildProcess`), by actor name."""
        return dict(self.supervisor.processes) if self.supervisor is not None else {}

    def remove_run_dir(self) -> None:
        """Remove the run's ipc directory (idempotent; errors ignored)."""
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


class AttachedRun:
    """A running run a session joined as one more client: it starts, stops and steps nothing.

    :meth:`serve` finds the run's actors and pings each; on leaving it resumes generation if
    this console paused it (:attr:`paused_here`), and the loop then closes this process's
    connections and nothing else.

    Args:
        attach: the run's output directory, attach card or one actor's address
            (:func:`replayrl.tools.run.attach_card.resolve_attach`).
        curve_keys: the key directory for a tcp address.
        ready_timeout: seconds to find the run (at most 10).
    """

    def __init__(self, attach: str, curve_keys: Any, *, ready_timeout: float) -> None:
        self.attach = attach
        self.curve_keys = curve_keys
        self.ready_timeout = ready_timeout
        self.target: AttachTarget | None = None
        self.directory: Directory | None = None
        self.paused_here = False
        """Set while this console holds generation paused (resumed on leaving)."""

    async def serve(self, ready: Callable[[], None], stopped: Callable[[], Awaitable[Any]]) -> None:
        """Find the run, call ``ready()``, wait for ``stopped()``, then undo this console's pause.

        Raises:
            replayrl.tools.run.attach_card.AttachError: ``attach`` names no live run.
        """
        self.target = await resolve_attach(self.attach, self.curve_keys,
                                           timeout=min(self.ready_timeout, 10.0))
        self.directory = self.target.directory
        ready()
        await stopped()
        if self.paused_here:
            try:
                await self.directory.proxy(MANAGER, 10.0).resume_generation()
                print("replayrl repl: generation resumed (this console had paused it)",
                      file=sys.stderr)
            except ActorError as exc:
                log.error("repl: could not resume generation on detach: %s", exc)

    async def guard(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await ``coro``: no processes of ours to watch (a lost peer fails the call with
        :class:`replayrl.actors.errors.PeerLost`). Raises whatever ``coro`` raises."""
        return await asyncio.ensure_future(coro)


def _consume_exception(future: asyncio.Future) -> None:
    # the watch's ActorDied is reported by the next call; keep asyncio from logging it as lost
    if not future.cancelled():
        future.exception()
