"""Start actors in their own processes and supervise them (fail fast, clean shutdown).

Each actor runs in a fresh Python process (no inherited torch / ZeroMQ state; started as
:mod:`replayrl.actors.child_process` says, without ``multiprocessing``) with its own
event loop (uvloop when installed), unless specs name one ``process`` for several actors: those
share one process and its event loop, each served under its own name and endpoint
(docs/design.md#colocate). The child ignores SIGINT, so Ctrl-C reaches only the
launcher, which then stops every actor in order; a child also exits by itself within about a
second when its parent disappears, so no process outlives the run. A child that dies writes
its traceback to ``<run_dir>/<name>.traceback`` (a shared process: ``<process>.traceback``) for
the supervisor to report.

Profiling: with ``REPLAYRL_PROFILE_DIR`` set in the environment, every actor process runs
under cProfile from the moment it serves until it stops and then writes ``<dir>/<name>.prof``
(``pstats`` data) and ``<dir>/<name>.txt`` (the top entries by own time and by cumulative
time); ``replayrl bench profile`` uses it. A process of several actors writes one profile, named
by its ``process``.
"""
from __future__ import annotations

import asyncio
import cProfile
import importlib
import io
import logging
import os
import pstats
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from replayrl.actors.actor import Actor, ActorServer
from replayrl.actors.child_process import ChildProcess, start_child
from replayrl.actors.directory import Directory
from replayrl.actors.errors import ActorDied, ActorError, PeerLost, RemoteError
from replayrl.actors.loop import run_event_loop
from replayrl.actors.process_title import set_process_title
from replayrl.actors.ref import (
    close_connections,
    connection_lost,
    use_curve_keys,
    use_heartbeat_deadline,
    use_shared_memory,
)
from replayrl.actors.run_dir import leave_run_dir

log = logging.getLogger(__name__)
_PARENT_POLL_SECONDS = 0.5
PROFILE_ENV = "REPLAYRL_PROFILE_DIR"
"""Environment variable: a directory where every actor process writes its cProfile."""


def write_profile(profile: cProfile.Profile, directory: str | Path, name: str,
                  top: int = 25) -> Path:
    """Write ``<directory>/<name>.prof`` and a text summary ``<name>.txt``; returns the text's path.

    The summary lists the ``top`` functions by own time (``tottime``) and by cumulative time.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    profile.dump_stats(str(out / f"{name}.prof"))
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    path = out / f"{name}.txt"
    path.write_text(text.getvalue())
    return path


@dataclass(frozen=True)
class ActorSpec:
    """What to start: ``cls`` as ``"package.module:ClassName"`` built with ``kwargs``.

    ``kwargs`` must be picklable (they cross the process boundary once, at start). ``cpus``:
    the CPU ids the process may run on (``os.sched_setaffinity``, set before the actor class is
    imported, so thread pools inherit it); empty = the parent's. ``process``: the process the
    actor runs in; specs whose ``process`` (or, where empty, name) is equal share one process:
    their actors are built in spec order and served in one event loop, each under its own name
    and endpoint (docs/design.md#colocate); they must agree on ``cpus`` and on every ``env``
    key they both set. Empty: a process of its own. ``thread``: in a shared process, serve this
    actor on an event loop of its own in a thread of its own, so its work overlaps with the
    others' where it releases the GIL (torch ops); the members without it share one loop.
    """

    name: str
    cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()
    process: str = ""
    thread: bool = False

    @property
    def process_key(self) -> str:
        """The name of the process this actor runs in: ``process``, or the actor's own name."""
        return self.process or self.name


def process_groups(specs: list[ActorSpec]) -> dict[str, tuple[ActorSpec, ...]]:
    """``specs`` grouped by process (:attr:`ActorSpec.process_key`), in order of first appearance;
    each group's specs in their order.

    Raises:
        ValueError: two specs of one process name different ``cpus`` or different values for
            one ``env`` key (the message names the process and both actors).
    """
    groups: dict[str, list[ActorSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.process_key, []).append(spec)
    for key, members in groups.items():
        first = members[0]
        for other in members[1:]:
            if other.cpus != first.cpus:
                raise ValueError(f"process {key!r}: actors {first.name!r} and {other.name!r} share "
                                 f"it but name different cpus {first.cpus} / {other.cpus}")
            clash = sorted(k for k in set(first.env) & set(other.env) if first.env[k] != other.env[k])
            if clash:
                raise ValueError(f"process {key!r}: actors {first.name!r} and {other.name!r} share "
                                 f"it but set different values for env {clash}")
    return {k: tuple(v) for k, v in groups.items()}


def import_object(path: str, what: str = "") -> Any:
    """The object named ``"package.module:qualname"`` (actor classes, hooks, reward functions).

    Args:
        what: the setting that named it (``"--custom-reward"``), put first in error messages.
    Raises:
        ValueError: not of that form, or the module / attribute does not exist (the message
            names ``what`` and ``path``).
    """
    prefix = f"{what} " if what else ""
    module, _, qualname = path.partition(":")
    if not module or not qualname:
        raise ValueError(f"{prefix}expected 'module:name', got {path!r}")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{prefix}{path}: {exc}") from None
    return obj


def import_callable(path: str, what: str = "") -> Any:
    """The callable named ``"package.module:qualname"`` (metrics hooks, reward functions).

    Args:
        what: the setting that named it, put first in error messages.
    Raises:
        ValueError: as :func:`import_object`, or the object is not callable.
    """
    obj = import_object(path, what)
    if not callable(obj):
        raise ValueError(f"{what + ' ' if what else ''}{path}: not callable")
    return obj


def import_actor_class(path: str) -> type[Actor]:
    """The Actor subclass named ``"package.module:ClassName"``.

    Raises:
        ValueError: as :func:`import_object`. TypeError: not an Actor subclass.
    """
    obj = import_object(path)
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise TypeError(f"{path} is not an Actor subclass")
    return obj


async def serve_actor(actor: Actor, name: str, directory: Directory,
                      parent_pid: int | None = None) -> str:
    """Run ``actor`` under ``name`` until ``__stop__`` (or until the parent process is gone).

    Returns:
        ``""``, or the failure ``__stop__`` was given (a torchrun driver stopping its ranks
        after the run failed: tools/run/torchrun_entry.py).
    """
    _use_directory(directory)
    profile_dir = os.environ.get(PROFILE_ENV)
    try:
        return await _serve(actor, name, directory, parent_pid,
                            cProfile.Profile() if profile_dir else None, profile_dir)
    finally:
        close_connections()


async def serve_actors(members: list[tuple[Actor, str]], directory: Directory,
                       parent_pid: int | None = None, process: str = "") -> list[str]:
    """Serve several actors in this process's one event loop, each ``(actor, name)`` under its
    own name and endpoint, as :func:`serve_actor` serves one: each starts (``on_start``) and
    serves on its own, answers its own calls, pings and ``__stop__``, and stops on its own;
    returns once every one has stopped (or the parent process is gone), with each one's
    failure (``""`` or what its ``__stop__`` was given), in order. One member only: exactly
    :func:`serve_actor`.

    ``process``: the name the process's profile is written under (``REPLAYRL_PROFILE_DIR``;
    one profile for the whole process, from before the first ``on_start`` until every member
    stopped).

    Raises:
        Whatever a member's ``on_start`` / ``on_stop`` raised (the others are cancelled when
        the event loop ends).
    """
    if len(members) == 1:
        return [await serve_actor(*members[0], directory, parent_pid)]
    _use_directory(directory)
    return await _serve_loop(members, directory, parent_pid, process, this_loop_only=False)


def serve_in_threads(loops: list[list[tuple[Actor, str]]], directory: Directory,
                     parent_pid: int | None, on_error: Callable[[str], Any]) -> list[str]:
    """Serve each list of ``(actor, name)`` of ``loops`` on an event loop of its own, in a thread
    of its own (as :func:`serve_actors` serves them, in its loop), until every actor stopped;
    returns each actor's failure text, in order. The process-wide connection settings are made
    once, here; each loop closes only its own connections. With ``REPLAYRL_PROFILE_DIR`` each
    loop writes its own profile, named by its actors (``a+b``).

    ``on_error(traceback_text)`` is called in the thread of a loop that raised (an ``on_start`` /
    ``on_stop`` error); it should end the process (the spawned child writes the traceback and
    exits), else that loop's actors are just gone.
    """
    _use_directory(directory)
    failures: list[list[str]] = [[] for _ in loops]

    def run(i: int) -> None:
        try:
            failures[i] = run_event_loop(_serve_loop(loops[i], directory, parent_pid))
        except BaseException:
            on_error(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(i,), daemon=True,
                                name=f"replayrl-{'+'.join(n for _, n in members)}")
               for i, members in enumerate(loops)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [f for loop in failures for f in loop]


DRIVER = "driver"
"""``ActorSpec.process`` of the actors a launcher serves in its own process and event loop
(:class:`DriverActors`) instead of spawning them; a :class:`Supervisor` given such specs runs
them in one spawned process of that name, as any shared ``process``."""


class DriverActors:
    """Actors built now and served in this process's running event loop, beside the caller's own
    work (the launcher's training loop), each as :func:`serve_actors` serves them: under its own
    name and endpoint, answering calls, pings and ``__stop__``.

    The launchers serve the version clock and the rollout manager so (``DRIVER``): neither
    imports torch, each holds a few MiB of its own, and a process apiece would cost a Python
    interpreter with ZeroMQ and numpy (40-85 MiB RSS each; docs/benchmarks.md, cut (15)). With
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
        _use_directory(self.directory)
        profile_dir = os.environ.get(PROFILE_ENV)
        profile = cProfile.Profile() if profile_dir else None
        if profile is not None:
            profile.enable()
        tasks = {asyncio.ensure_future(_serve(actor, name, self.directory, None, None, None)): name
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


async def _serve_loop(members: list[tuple[Actor, str]], directory: Directory,
                      parent_pid: int | None, profile_name: str = "",
                      this_loop_only: bool = True) -> list[str]:
    """``members`` served together on the running loop, under one profile (named
    ``profile_name``, else by the members ``a+b``); then the loop's connections are closed: only
    its own (``this_loop_only``: one of :func:`serve_in_threads`' threads) or every one of the
    process (:func:`serve_actors`, the process's only loop)."""
    profile_dir = os.environ.get(PROFILE_ENV)
    profile = cProfile.Profile() if profile_dir else None
    if profile is not None:
        profile.enable()
    try:
        return list(await asyncio.gather(*(_serve(actor, name, directory, parent_pid, None, None)
                                           for actor, name in members)))
    finally:
        if profile is not None:
            profile.disable()
            write_profile(profile, profile_dir, profile_name or "+".join(n for _, n in members))
        close_connections(this_loop_only=this_loop_only)


def _use_directory(directory: Directory) -> None:
    """This process's connections use the run's CURVE keys, heartbeat deadline and shared memory."""
    use_curve_keys(directory.keys())
    use_heartbeat_deadline(directory.heartbeat_deadline_s)
    use_shared_memory(*directory.shm)


async def _serve(actor: Actor, name: str, directory: Directory, parent_pid: int | None,
                 profile: cProfile.Profile | None, profile_dir: str | None) -> str:
    """Start ``actor`` and serve it until ``__stop__`` or the parent is gone; its failure text.
    Leaves this process's connections open (the caller closes them)."""
    actor.name, actor.directory = name, directory
    await actor.on_start()
    server = ActorServer(actor, directory.endpoint(name), curve=directory.keys())
    if profile is not None:
        profile.enable()
    server.start()
    try:
        while not server.stopped.is_set():
            try:
                await asyncio.wait_for(server.stopped.wait(), _PARENT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if parent_pid is not None and os.getppid() != parent_pid:
                    log.warning("%s: parent %d is gone; stopping", name, parent_pid)
                    break
        await asyncio.sleep(0.05)  # let the reply to __stop__ leave the socket
        return server.failure
    finally:
        if profile is not None:
            profile.disable()
            write_profile(profile, profile_dir, name)
        try:
            await actor.on_stop()
        finally:
            server.close()


def _child_main(specs: tuple[ActorSpec, ...], endpoints: dict[str, str], curve_keys: str,
                heartbeat_deadline_s: float, shm: tuple[int, int], parent_pid: int, run_dir: str,
                log_level: int, run_name: str) -> None:
    """One actor process: build the actors of ``specs`` (one process, :func:`process_groups`)
    in order, serve them until each stopped; a failure writes ``<process>.traceback``."""
    key = specs[0].process_key
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C
    set_process_title(key, run_name or run_dir)
    for spec in specs:
        os.environ.update(spec.env)
    if specs[0].cpus:
        os.sched_setaffinity(0, specs[0].cpus)
    logging.basicConfig(level=log_level, format=f"%(asctime)s {key} %(levelname)s %(message)s")

    def die(text: str) -> None:
        try:
            Path(run_dir, f"{key}.traceback").write_text(text)
        finally:
            sys.stderr.write(f"[{key}] died:\n{text}")
            sys.stderr.flush()
            os._exit(1)

    try:
        members = [(import_actor_class(spec.cls)(**spec.kwargs), spec.name) for spec in specs]
        directory = Directory(endpoints, curve_keys, heartbeat_deadline_s, shm)
        shared = [m for m, spec in zip(members, specs) if not spec.thread]
        own = [[m] for m, spec in zip(members, specs) if spec.thread]
        if len(members) > 1 and own:  # loops of their own: the members without thread share one
            serve_in_threads(([shared] if shared else []) + own, directory, parent_pid, die)
        else:
            run_event_loop(serve_actors(members, directory, parent_pid, key))
        if os.getppid() != parent_pid:  # the launcher was killed: nobody else will clean up
            leave_run_dir(run_dir)
    except BaseException:
        die(traceback.format_exc())


LOSS_POLICIES = ("fail", "drop", "replace")
"""What a :class:`Supervisor` does when an expendable actor is lost: end the run, go on
without it, or start a fresh process in its place."""


class Supervisor:
    """Owns the actor processes of a run: start, wait until ready, watch, stop.

    Use as ``async with Supervisor(...) as sup:``; leaving the block stops every actor (a polite
    ``__stop__``, then SIGTERM, then SIGKILL) and removes the run's ipc files.

    An actor is *lost* when its process exits or when it stays silent past the directory's
    heartbeat deadline (this process's connection to it drops, e.g. a SIGSTOPped process);
    a silent one is killed (SIGKILL) so it can never come back with stale state. A lost actor
    ends the run (:meth:`watch` raises :class:`ActorDied`) unless it is one of ``expendable``
    and ``on_lost`` says otherwise (docs/design.md#engine-faults).

    Actors whose specs name one ``process`` (:func:`process_groups`) run in one process:
    ``processes`` maps each of their names to it, its exit is every member's loss (the
    :class:`ActorDied` names them all), and :meth:`shutdown` sends each member ``__stop__``,
    then ends the process once (docs/design.md#colocate).

    Args:
        expendable: names of actors the run can lose (the rollout engines).
        on_lost: for an expendable actor: ``"fail"`` (end the run), ``"drop"`` (go on without
            it; the run ends once every expendable actor is lost) or ``"replace"`` (start a new
            process for it under the same name and endpoint, then await ``on_replaced(name)``
            once it answers ``__ping__``).
        kept: actors that do the ``expendable`` actors' work but that the run cannot lose (a
            colocated ``engine_0``, which shares the trainer's process): under ``"drop"``, while
            one of them lives, losing every expendable actor does not end the run.
        on_replaced: coroutine function called with the name of a replaced actor once it
            serves (the launcher pushes the current weights to a replaced engine); its error
            ends the run. An expendable actor that shares its process with others can only be
            lost with them: it needs ``on_lost="fail"``.
        run_name: the run in each actor process's title (``ps``: ``replayrl actor NAME run
            RUN``, :mod:`replayrl.actors.process_title`); empty: ``run_dir``.
    Raises:
        ValueError: duplicate names, an unknown ``on_lost``, an ``expendable`` or ``kept`` name
            that is not among ``specs``, one that shares its process while ``on_lost`` is not
            ``"fail"``, or specs of one process that disagree (:func:`process_groups`).
    """

    def __init__(self, specs: list[ActorSpec], directory: Directory, run_dir: str | Path,
                 *, ready_timeout: float = 120.0, log_level: int = logging.WARNING,
                 expendable: tuple[str, ...] = (), on_lost: str = "fail",
                 on_replaced: Callable[[str], Awaitable[Any]] | None = None,
                 run_name: str = "", kept: tuple[str, ...] = ()) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"actor names must be unique, got {names}")
        if on_lost not in LOSS_POLICIES:
            raise ValueError(f"on_lost must be one of {LOSS_POLICIES}, got {on_lost!r}")
        if unknown := sorted(set(expendable) - set(names)):
            raise ValueError(f"expendable actors {unknown} are not among {names}")
        if unknown := sorted(set(kept) - set(names)):
            raise ValueError(f"kept actors {unknown} are not among {names}")
        self.groups = process_groups(specs)
        self._process_of = {s.name: s.process_key for s in specs}
        if on_lost != "fail":
            shared = sorted(n for n in expendable if len(self.groups[self._process_of[n]]) > 1)
            if shared:
                raise ValueError(f"expendable actors {shared} share a process with other actors: "
                                 f"they can only be lost with them, so on_lost must be 'fail', "
                                 f"got {on_lost!r}")
        self.specs = specs
        self.directory = directory
        self.run_dir = Path(run_dir)
        self.ready_timeout = ready_timeout
        self.log_level = log_level
        self.expendable = tuple(expendable)
        self.kept = tuple(kept)
        self.on_lost = on_lost
        self.on_replaced = on_replaced
        self.run_name = run_name
        self.processes: dict[str, ChildProcess] = {}
        self.dropped: dict[str, str] = {}  # name -> why it was lost (on_lost "drop")
        self.replacements: dict[str, int] = {}  # name -> processes started in its place
        self._replacing: dict[str, asyncio.Task] = {}
        self._silenced: dict[str, str] = {}  # process key -> why it was killed, until handled
        self._stopping = False

    async def __aenter__(self) -> "Supervisor":
        self.start()
        try:
            await self.wait_ready()
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def start(self) -> None:
        """Start every actor process (returns at once; see :meth:`wait_ready`); this process's
        calls to them use the directory's CURVE keys and heartbeat deadline."""
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _use_directory(self.directory)
        for key in self.groups:
            self._start(key)

    def _start(self, key: str) -> None:
        """Start the process ``key`` (:attr:`ActorSpec.process_key`) with every actor of it."""
        group = self.groups[key]
        proc = start_child(_child_main, (group, self.directory.to_dict(), self.directory.curve_keys,
                                         self.directory.heartbeat_deadline_s, self.directory.shm,
                                         os.getpid(), str(self.run_dir), self.log_level,
                                         self.run_name), name=f"replayrl-{key}")
        for spec in group:
            self.processes[spec.name] = proc

    def _members(self, name: str) -> tuple[str, ...]:
        """Every actor of ``name``'s process, ``name`` included, in spec order."""
        return tuple(s.name for s in self.groups[self._process_of[name]])

    def _exited(self, name: str) -> ActorDied:
        key = self._process_of[name]
        members = self._members(name) if len(self.groups[key]) > 1 else ()
        if key in self._silenced:
            return ActorDied(name, self.processes[name].exitcode, self._silenced[key], members)
        tb_file = self.run_dir / f"{key}.traceback"
        text = tb_file.read_text() if tb_file.exists() else ""
        return ActorDied(name, self.processes[name].exitcode, text, members)

    def died(self) -> ActorDied | None:
        """An :class:`ActorDied` for the first process that exited, or None while all live
        (actors already dropped under ``on_lost="drop"`` do not count)."""
        exited = self._exit_codes()
        for name, proc in self.processes.items():
            if exited[id(proc)] is not None and name not in self.dropped:
                return self._exited(name)
        return None

    def _exit_codes(self) -> dict[int, int | None]:
        """``id(process)`` -> its exit code (None: running), read once per process, so the
        members of a shared process agree: read per member, a process that exits between two
        reads would be reported under its second member instead of its first."""
        unique = {id(proc): proc for proc in self.processes.values()}
        return {key: proc.exitcode for key, proc in unique.items()}

    async def explain(self, exc: BaseException, grace: float = 5.0) -> BaseException:
        """The error to report for ``exc``: a :class:`PeerLost` caused by an actor process that
        exited (or went silent, then killed) becomes that process's :class:`ActorDied` (with
        its traceback), waiting up to ``grace`` seconds for the exit to show; so does a
        :class:`RemoteError` whose remote type is ``PeerLost`` (an actor's own call cut off,
        e.g. the trainer's call to a dead clock). Anything else is returned as it is."""
        cut_off = isinstance(exc, PeerLost) or (isinstance(exc, RemoteError)
                                                and exc.remote_type == "PeerLost")
        if not cut_off:
            return exc
        deadline = time.monotonic() + grace
        while (dead := (self._kill_silent(), self.died())[1]) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return dead if dead is not None else exc

    async def wait_ready(self, names: list[str] | None = None) -> None:
        """Ping every actor (or those of ``names``) until it answers.

        Raises:
            ActorDied: a process exited while starting (with its traceback).
            ActorError: not all actors answered within ``ready_timeout`` seconds.
        """
        deadline = time.monotonic() + self.ready_timeout
        for name in names if names is not None else list(self.processes):
            ref = self.directory.ref(name)
            while True:
                if self.processes[name].exitcode is not None:
                    raise self._exited(name)
                try:
                    await ref.call("__ping__", timeout=0.5)
                    break
                except ActorError as last:
                    if time.monotonic() > deadline:
                        raise ActorError(f"actor {name!r} not ready after {self.ready_timeout} s") from last
                    await asyncio.sleep(0.05)  # a call on a lost connection fails at once

    def _silent(self, name: str) -> str | None:
        """Why ``name``'s connection is lost while its process still runs (a stopped or hung
        process past the heartbeat deadline), or None. A process being replaced is not judged
        until it answered its first ping."""
        if name in self._replacing or name in self.dropped:
            return None
        return connection_lost(self.directory.endpoint(name))

    def _kill_silent(self) -> None:
        """SIGKILL every live process whose connection is lost (silent past the deadline), so
        it is handled as an exit and can never come back with stale state."""
        for name, proc in self.processes.items():
            if proc.exitcode is not None or (silent := self._silent(name)) is None:
                continue
            proc.join(0.2)  # a process that just exited drops its connection first
            if proc.exitcode is not None:
                continue
            why = (f"silent for {self.directory.heartbeat_deadline_s} s (heartbeat deadline; "
                   f"{silent}); killed")
            log.warning("%s: %s", name, why)
            self._silenced[self._process_of[name]] = why
            proc.kill()
            proc.join(5.0)

    def _check(self) -> None:
        """Handle every lost actor once: kill the silent, then fail / drop / replace the exited.

        Raises:
            ActorDied: a lost actor the run cannot do without, or the last expendable one.
            Whatever ``on_replaced`` raised for a replacement.
        """
        for name, task in list(self._replacing.items()):
            if task.done():
                del self._replacing[name]
                task.result()  # its error ends the run
        self._kill_silent()
        exited = self._exit_codes()
        for name, proc in list(self.processes.items()):
            if name in self.dropped or self._stopping or exited[id(proc)] is None:
                continue
            dead = self._exited(name)
            why = self._silenced.pop(self._process_of[name], "")
            if name not in self.expendable or self.on_lost == "fail":
                raise dead
            if (starting := self._replacing.pop(name, None)) is not None:
                starting.cancel()
            if self.on_lost == "drop":
                self.dropped[name] = why or f"exited with code {proc.exitcode}"
                if all(n in self.dropped for n in self.expendable) and not self.kept:
                    # (a kept actor's own loss ends the run above: it is not expendable)
                    raise ActorDied(name, proc.exitcode,
                                    f"every one of {list(self.expendable)} is lost; the last: "
                                    f"{self.dropped[name]}")
                log.warning("%s lost (%s); going on without it", name, self.dropped[name])
            else:
                log.warning("%s lost (%s); starting a new process in its place",
                            name, why or f"exit code {proc.exitcode}")
                Path(self.run_dir, f"{self._process_of[name]}.traceback").unlink(missing_ok=True)
                self.replacements[name] = self.replacements.get(name, 0) + 1
                self._start(self._process_of[name])  # a process of its own: see __init__
                self._replacing[name] = asyncio.ensure_future(self._replaced(name))

    async def _replaced(self, name: str) -> None:
        await self.wait_ready([name])
        if self.on_replaced is not None:
            await self.on_replaced(name)

    async def watch(self) -> None:
        """Return never; raise :class:`ActorDied` as soon as an actor is lost that the run
        cannot do without (see the class docstring), after killing it if it was silent."""
        loop = asyncio.get_running_loop()
        poll = min(1.0, self.directory.heartbeat_deadline_s / 4)
        try:
            while True:
                self._check()
                waiter = loop.create_future()
                fds = list(dict.fromkeys(p.sentinel for n, p in self.processes.items()
                                         if n not in self.dropped))
                for fd in fds:
                    loop.add_reader(fd, lambda: waiter.done() or waiter.set_result(None))
                try:
                    await asyncio.wait_for(waiter, poll)
                except asyncio.TimeoutError:
                    pass
                finally:
                    for fd in fds:
                        loop.remove_reader(fd)
        finally:
            for task in self._replacing.values():
                task.cancel()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every actor: ``__stop__`` to each live one, then SIGTERM / SIGKILL stragglers."""
        self._stopping = True
        live = [n for n, p in self.processes.items() if p.exitcode is None]
        await asyncio.gather(*(self._polite_stop(n, timeout / 2) for n in live),
                             return_exceptions=True)
        deadline = time.monotonic() + timeout
        for proc in dict.fromkeys(self.processes.values()):  # a shared process once
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.terminate()
                proc.join(1.0)
            if proc.exitcode is None:
                proc.kill()
                proc.join(1.0)
        close_connections()
        # a killed actor leaves its ipc file; only this supervisor's actors: others in the
        # directory (a launcher's DriverActors) still serve
        for endpoint in (self.directory.endpoints[s.name] for s in self.specs):
            if endpoint.startswith("ipc://"):
                Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)

    async def _polite_stop(self, name: str, timeout: float) -> None:
        try:
            await self.directory.ref(name).call("__stop__", timeout=timeout)
        except ActorError:
            pass
