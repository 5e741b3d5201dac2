"""Actors the launcher serves in its own process and event loop, beside its training loop
(:class:`DriverActors`), instead of a process apiece (docs/design/actors.md#colocate)."""
from __future__ import annotations

import asyncio
import cProfile
import os
from typing import Any, Awaitable

from replayrl.actors.actor import Actor
from replayrl.actors.directory import Directory
from replayrl.actors.errors import ActorDied, ActorError
from replayrl.actors.objects import import_actor_class
from replayrl.actors.profiling import PROFILE_ENV, write_profile
from replayrl.actors.ref import close_connections
from replayrl.actors.serve import serve_until_stopped, use_directory
from replayrl.actors.spec import ActorSpec

DRIVER = "driver"
"""``ActorSpec.process`` of the actors a launcher serves in its own process and event loop
(:class:`DriverActors`) instead of spawning them; a :class:`~replayrl.actors.supervisor.Supervisor`
given such specs runs them in one spawned process of that name, as any shared ``process``."""


class DriverActors:
    """Actors built now and served in this process's running event loop, beside the caller's own
    work (the launcher's training loop), each as :func:`~replayrl.actors.serve.serve_actors` serves them: under its own
    name and endpoint, answering calls, pings and ``__stop__``.

    The launchers serve the version clock and the rollout manager so (``DRIVER``): neither
    imports torch, each holds a few MiB of its own, and a process apiece would cost a Python
    interpreter with ZeroMQ and numpy (40-85 MiB RSS each; docs/benchmarks.md). With
    ``REPLAYRL_PROFILE_DIR`` set the driver process writes one profile, ``driver``, that holds
    the caller's own work too.

    Build inside a running event loop; an empty ``specs`` serves nothing.

    Raises:
        ValueError: ``specs`` name one actor twice.
        Whatever an actor class's import or constructor raises (before anything is served; the
        launchers build these first, before any process starts).
    """

    def __init__(self, specs: list[ActorSpec], directory: Directory) -> None:
        self.names = tuple(s.name for s in specs)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"actor names must be unique, got {list(self.names)}")
        self.directory = directory
        self._stopping = False
        members = [(import_actor_class(s.cls)(**s.kwargs), s.name) for s in specs]
        self.task = asyncio.ensure_future(self._serve_members(members)) if members else None

    async def _serve_members(self, members: list[tuple[Actor, str]]) -> list[str]:
        """Each member served as a task of its own; ends when all stopped after :meth:`stop`, or
        at the first member that ended before it (the others are cancelled, which runs their
        ``on_stop``): an error it raised, or :class:`ActorDied` for one that was sent
        ``__stop__`` by someone else (a console attached to the run) while the run needs it."""
        use_directory(self.directory)
        profile_dir = os.environ.get(PROFILE_ENV)
        profile = cProfile.Profile() if profile_dir else None
        if profile is not None:
            profile.enable()
        tasks = {asyncio.ensure_future(serve_until_stopped(actor, name, self.directory, None)): name
                 for actor, name in members}
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
                    if not self._stopping:
                        given = f": {task.result()}" if task.result() else ""
                        raise ActorDied(tasks[task], None, "it was sent __stop__ before the run "
                                        f"ended{given}")
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if profile is not None:
                profile.disable()
                write_profile(profile, profile_dir, DRIVER)
            close_connections()

    async def beside(self, work: Awaitable[Any]) -> Any:
        """Await ``work`` (the driver's training loop) while the members serve; returns its result.

        Raises:
            What ended the serving first (:meth:`failure`; ``work`` is cancelled then), else
            whatever ``work`` raised.
        """
        work_task = asyncio.ensure_future(work)
        waited = {work_task, *([self.task] if self.task is not None else [])}
        try:
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work_task.done():
                work_task.cancel()
                await asyncio.gather(work_task, return_exceptions=True)
        if self.failure() is not None:
            raise self.failure()
        return work_task.result()

    def failure(self) -> BaseException | None:
        """What ended the serving before :meth:`stop`, else None: a member's ``on_start`` /
        ``on_stop`` error, or :class:`ActorDied` naming a member stopped by someone else's
        ``__stop__``."""
        if self.task is None or not self.task.done() or self.task.cancelled():
            return None
        return self.task.exception()

    async def stop(self, failure: str = "", timeout: float = 5.0) -> None:
        """Send each member ``__stop__`` (with ``failure``, the text a stopped actor reports) and
        wait until all stopped; a member that did not get it within ``timeout`` seconds (its ipc
        file removed under it, say) is cancelled, which still runs its ``on_stop``. Never raises
        (see :meth:`failure`)."""
        if self.task is None:
            return
        self._stopping = True
        for name in self.names:
            if self.task.done():
                break
            try:
                await self.directory.ref(name).call("__stop__", failure, timeout=timeout)
            except ActorError:
                pass
        await asyncio.wait({self.task}, timeout=timeout)
        if not self.task.done():
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
