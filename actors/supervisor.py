"""The launcher's side of the actor processes (:class:`Supervisor`): start them (each runs
:func:`~replayrl.actors.actor_process.actor_process_main`), wait until they serve, watch for a
lost one (fail, drop or replace it), stop them all (fail fast, clean shutdown)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

from replayrl.actors.actor_process import actor_process_main
from replayrl.actors.child_process import ChildProcess, start_child
from replayrl.actors.directory import Directory
from replayrl.actors.errors import ActorDied, ActorError, ActorTimeout, PeerLost, RemoteError
from replayrl.actors.ref import close_connections, connection_lost
from replayrl.actors.serve import use_directory
from replayrl.actors.spec import ActorSpec, process_groups

log = logging.getLogger(__name__)

WAITING_REPORT_S = (5.0, 15.0)
"""A :class:`Supervisor` reports an actor start it still waits for after this many seconds,
then every so many more (``on_waiting``): a normal start of the default run takes about 5 s
on an idle 2-core machine (docs/fault-tolerance.md)."""

STACK_DUMP_WAIT_S = 1.0
"""Seconds a :class:`Supervisor` gives an actor that did not start in time to print its
stacks (SIGUSR1) before it is stopped."""

LOSS_POLICIES = ("fail", "drop", "replace")
"""What a :class:`Supervisor` does when an expendable actor is lost: end the run, go on
without it, or start a fresh process in its place."""

MAX_FAILED_STARTS = 3
"""Replacements of one actor (``on_lost="replace"``) that may be lost in a row while starting
(or being restored) before its loss ends the run: a kill during a restart is bad luck, a
process that dies on every start is broken."""

EXIT_SHOW_S = 1.0
"""Seconds to wait for a replacement's exit to show once a call to it was cut off."""


class Supervisor:
    """Owns the actor processes of a run: start, wait until ready, watch, stop.

    Use as ``async with Supervisor(...) as sup:``; leaving the block stops every actor (a polite
    ``__stop__``, then SIGTERM, then SIGKILL) and removes the run's ipc files.

    An actor is *lost* when its process exits or when it stays silent past the directory's
    heartbeat deadline (this process's connection to it drops, e.g. a SIGSTOPped process);
    a silent one is killed (SIGKILL) so it can never come back with stale state. A lost actor
    ends the run (:meth:`watch` raises :class:`ActorDied`) unless it is one of ``expendable``
    and ``on_lost`` says otherwise (docs/design/engine-faults.md#engine-faults).

    Actors whose specs name one ``process`` (:func:`process_groups`) run in one process:
    ``processes`` maps each of their names to it, its exit is every member's loss (the
    :class:`ActorDied` names them all), and :meth:`shutdown` sends each member ``__stop__``,
    then ends the process once (docs/design/actors.md#colocate).

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
        ready_timeout: seconds from its process's start within which an actor must answer its
            first ``__ping__`` (:meth:`wait_ready`); ``ready_timeouts`` overrides it per actor
            name (an engine that starts vLLM or waits for a server gets longer).
        on_waiting: ``on_waiting(waiting, seconds, timeout)``, called while :meth:`wait_ready`
            waits: first after ``waiting_report_s[0]`` seconds, then every
            ``waiting_report_s[1]``, with the actors not yet answering (in start order), the
            seconds since their start and the first one's timeout; the launcher
            prints it, so a slow start shows which actor it waits for.
        timeout_hint: appended to the error of an actor that did not start in time (the
            launcher names the flag that sets the timeout).
    Raises:
        ValueError: duplicate names, an unknown ``on_lost``, an ``expendable`` or ``kept`` name
            that is not among ``specs``, one that shares its process while ``on_lost`` is not
            ``"fail"``, or specs of one process that disagree (:func:`process_groups`).
    """

    def __init__(self, specs: list[ActorSpec], directory: Directory, run_dir: str | Path,
                 *, ready_timeout: float = 120.0, log_level: int = logging.WARNING,
                 expendable: tuple[str, ...] = (), on_lost: str = "fail",
                 on_replaced: Callable[[str], Awaitable[Any]] | None = None,
                 run_name: str = "", kept: tuple[str, ...] = (),
                 ready_timeouts: Mapping[str, float] | None = None,
                 on_waiting: Callable[[list[str], float, float], Any] | None = None,
                 waiting_report_s: tuple[float, float] = WAITING_REPORT_S,
                 timeout_hint: str = "") -> None:
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
        self.ready_timeouts = dict(ready_timeouts or {})
        self.on_waiting = on_waiting
        self.waiting_report_s = waiting_report_s
        self.timeout_hint = timeout_hint
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
        self._failed_starts: dict[str, int] = {}  # name -> replacements lost while starting, in a row
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
        use_directory(self.directory)
        for key in self.groups:
            self._start(key)

    def _start(self, key: str) -> None:
        """Start the process ``key`` (:attr:`ActorSpec.process_key`) with every actor of it."""
        group = self.groups[key]
        proc = start_child(actor_process_main,
                           (group, self.directory.to_dict(), self.directory.curve_keys,
                            self.directory.heartbeat_deadline_s, self.directory.shm, os.getpid(),
                            str(self.run_dir), self.log_level, self.run_name),
                           name=f"replayrl-{key}")
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
        """Ping every actor (or those of ``names``) until it answers, reporting the wait to
        ``on_waiting`` (see the class docstring).

        Raises:
            ActorDied: a process exited while starting (with its traceback).
            ActorTimeout: an actor did not answer within its ready timeout, counted from now
                (its processes were started just before); the message names it and its pid.
                Its process is first asked (SIGUSR1, :mod:`faulthandler`) to print every
                thread's Python stack to stderr: where it is stuck.
        """
        started = time.monotonic()
        waiting = list(names if names is not None else self.processes)
        report_at = started + self.waiting_report_s[0]
        while True:
            for name in waiting:  # a process that died while starting fails the start at once
                if self.processes[name].exitcode is not None:
                    raise self._exited(name)
            answers = await asyncio.gather(*(self.directory.ref(name).call("__ping__", timeout=0.5)
                                             for name in waiting), return_exceptions=True)
            errors = {name: a for name, a in zip(waiting, answers) if isinstance(a, ActorError)}
            for answer in answers:
                if isinstance(answer, BaseException) and not isinstance(answer, ActorError):
                    raise answer
            waiting = [name for name in waiting if name in errors]
            if not waiting:
                return
            now = time.monotonic()
            for name in waiting:
                timeout = self.ready_timeouts.get(name, self.ready_timeout)
                if now - started > timeout:
                    raise self._not_started(name, timeout) from errors[name]
            if self.on_waiting is not None and now >= report_at:
                report_at = now + self.waiting_report_s[1]
                self.on_waiting(list(waiting), now - started,
                                self.ready_timeouts.get(waiting[0], self.ready_timeout))
            await asyncio.sleep(0.05)  # a call on a lost connection fails at once

    def _not_started(self, name: str, timeout: float) -> ActorTimeout:
        """The error of actor ``name``, not answering after ``timeout`` seconds; its process
        prints its threads' stacks first (:func:`actor_process_main` registers SIGUSR1)."""
        proc = self.processes[name]
        try:
            proc.send_signal(signal.SIGUSR1)
            proc.join(STACK_DUMP_WAIT_S)  # the dump is written by the process itself
        except ProcessLookupError:
            pass
        hint = f"; {self.timeout_hint}" if self.timeout_hint else ""
        return ActorTimeout(f"actor {name!r} (pid {proc.pid}) did not answer its first ping within "
                            f"{timeout:g} s of its start; its Python stacks are printed above"
                            f"{hint}")

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
                self._replacement_done(name, task)
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
                self._failed_start(name)
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

    def _replacement_done(self, name: str, task: asyncio.Task) -> None:
        """Judge a finished replacement of ``name``: served, it resets the failed starts; a
        replacement whose own process exited (or was killed) while starting or being restored
        is one more loss of ``name``, left in :attr:`processes` for :meth:`_check` to replace
        again, up to :data:`MAX_FAILED_STARTS` in a row (a process that keeps dying as it
        starts is broken, not unlucky); any other error ends the run.

        Raises:
            ActorDied: the :data:`MAX_FAILED_STARTS`-th failed start in a row (its traceback).
            Whatever the replacement raised while its process still runs.
        """
        if task.cancelled() or task.exception() is None:
            self._failed_starts.pop(name, None)
            return
        proc = self.processes[name]
        if proc.exitcode is None:  # a call cut off by the dying process can beat its exit
            proc.join(EXIT_SHOW_S)
        if proc.exitcode is None:
            task.result()  # its error ends the run
        self._failed_start(name)

    def _failed_start(self, name: str) -> None:
        """Count a replacement of ``name`` lost while starting.

        Raises:
            ActorDied: the :data:`MAX_FAILED_STARTS`-th in a row (with its traceback).
        """
        proc = self.processes[name]
        failed = self._failed_starts[name] = self._failed_starts.get(name, 0) + 1
        if failed >= MAX_FAILED_STARTS:
            dead = self._exited(name)
            raise ActorDied(name, proc.exitcode, f"{failed} replacements in a row were lost "
                            f"while starting; the last: {dead.traceback_text or 'no traceback'}",
                            dead.members)
        log.warning("%s: its replacement was lost while starting (exit code %s, %d in a row)",
                    name, proc.exitcode, failed)

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
