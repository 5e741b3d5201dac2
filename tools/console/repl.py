"""``replayrl repl``: an interactive Python console on the live actors of a run.

Two ways in (docs/design/multi-host.md#attach-and-multi-host):

* ``replayrl repl [run flags]`` starts the run's actors from ``replayrl train``'s specs, under a
  :class:`replayrl.actors.Supervisor` (a process per engine and trainer; the clock and the
  manager, which ``replayrl train`` serves in its own loop, share one process), but nothing
  drives the loop: the user does, one call (or ``step(k)``) at a time. Leaving stops every actor.
* ``replayrl repl --attach OUTPUT_DIR`` (the run's ``attach.json``, :mod:`replayrl.tools.run.attach_card``) or
  ``--attach tcp://host:port --curve-keys DIR`` (any one actor's address) joins a run that a
  launcher drives. The console is one more client of the actors: it starts, stops and steps
  nothing; leaving closes only its own connections (and resumes generation if this console
  paused it), so the run goes on as if no one had looked.

The actor runtime is asyncio and a connection belongs to the event loop that opened it, so the
session runs one event loop in a background thread
(:class:`replayrl.tools.console.actor_loop.ActorLoop`) and the console (main thread,
:class:`replayrl.tools.console.prompt.Console`) hands every call to it with
:func:`asyncio.run_coroutine_threadsafe`, blocking until the reply.

A session is put together from one object per job: the run it serves
(:class:`replayrl.tools.console.runs.OwnRun`, the actor processes it starts and stops, or
:class:`replayrl.tools.console.runs.AttachedRun`), the loop thread, the helpers that ask the run
and show the answer (:class:`replayrl.tools.console.helpers.ConsoleHelpers`) and the console
namespace with one proxy per actor (:mod:`replayrl.tools.console.namespace`, see its
:data:`replayrl.tools.console.namespace.HELP_TEXT`).
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Coroutine

from replayrl.actors import ActorSpec, Directory, Supervisor
from replayrl.tools.console.actor_loop import ActorLoop
from replayrl.tools.console.helpers import ConsoleHelpers
from replayrl.tools.console.namespace import HELP_TEXT, ConsoleMethod, ConsoleProxy, build_namespace
from replayrl.tools.console.prompt import Console
from replayrl.tools.console.runs import CLOCK, MANAGER, AttachedRun, OwnRun
from replayrl.tools.errors import ReplError, SessionClosed
from replayrl.tools.run.attach_card import AttachTarget
from replayrl.tools.run.config import RunConfig
from replayrl.tools.run.exit_codes import exit_code
from replayrl.tools.run.from_flags import config_from_args
from replayrl.tools.run.train_loop import step_metrics, sync_step

__all__ = ["ReplSession", "ReplError", "SessionClosed", "ConsoleProxy", "ConsoleMethod",
           "HELP_TEXT", "MANAGER", "CLOCK", "DEFAULT_CALL_TIMEOUT", "DEFAULT_STEP_TIMEOUT", "main"]

DEFAULT_CALL_TIMEOUT = 60.0
"""Seconds a proxied call (``trainer.state()``, ``call(...)``) waits for its reply by default."""

DEFAULT_STEP_TIMEOUT = 600.0
"""Seconds each of ``step``'s three calls (generate, train, push) may take."""


class ReplSession:
    """The actors of one run plus an event loop thread that talks to them.

    Use as ``with ReplSession(config) as session: session.namespace["trainer"].state()``.

    Own actors (``attach`` empty): :meth:`start` writes the initial checkpoint to
    ``<config.output_dir>/checkpoint-init`` (only when ``specs`` is None and there is no
    ``--hf-checkpoint``), starts every actor and waits until each answers ``__ping__``;
    :meth:`stop` stops them all (polite ``__stop__``, then SIGTERM / SIGKILL), joins the loop
    thread and removes the run's ipc directory.

    Attached (``attach`` names a run, :func:`replayrl.tools.run.attach_card.resolve_attach`): :meth:`start`
    finds the run's actors and pings each; :meth:`stop` resumes generation if this session
    paused it, then closes this process's connections and nothing else. Both are idempotent.

    The console's helpers (``methods``, ``clock``, ``metrics``, ``sample``, ``pause``,
    ``resume``) are :attr:`helpers`, a :class:`replayrl.tools.console.helpers.ConsoleHelpers`
    once started; :attr:`namespace` is the console's globals.

    Args:
        config: the run's configuration (``config.transport`` picks ipc or tcp endpoints; when
            attaching, ``config.curve_keys`` are the keys for a tcp address).
        specs: actor specs replacing :func:`replayrl.tools.run.launcher.actor_specs` (tests use small actors).
        attach: a running run's output directory, attach card or one actor's address.
        call_timeout: default reply timeout of proxied calls, in seconds.
        ready_timeout: seconds every actor gets to answer its first ping (None:
            ``--actor-start-timeout-seconds``, as a run's actors get).
        log_level: logging level inside the actor processes.

    Raises:
        ReplError: both ``specs`` and ``attach`` given.
    """

    def __init__(self, config: RunConfig, specs: list[ActorSpec] | None = None, *,
                 attach: str = "", call_timeout: float = DEFAULT_CALL_TIMEOUT,
                 ready_timeout: float | None = None, log_level: int = logging.WARNING) -> None:
        if attach and specs is not None:
            raise ReplError("an attached session starts no actors: give specs or attach, not both")
        self.config = config
        self.attach = attach
        self.call_timeout = call_timeout
        self.ready_timeout = config.actor_start_timeout_s if ready_timeout is None else ready_timeout
        self.log_level = log_level
        self._specs = specs
        self.namespace: dict[str, Any] = {}
        self.rows: list[dict] = []  # step() results of a session's own run
        self.helpers: ConsoleHelpers | None = None
        self._run: OwnRun | AttachedRun | None = None
        self._loop = ActorLoop("detach failed" if attach else "actor shutdown failed")

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "ReplSession":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "ReplSession":
        """Start (or attach to) every actor and fill :attr:`namespace`; returns ``self``.

        Raises:
            replayrl.actors.ActorDied: an actor process exited while starting (its traceback attached).
            replayrl.actors.ActorError: an actor did not answer within ``ready_timeout`` seconds.
            replayrl.tools.run.attach_card.AttachError: ``attach`` names no live run.
            ReplError: the session was already started.
        """
        if self._loop.started:
            raise ReplError("a ReplSession can be started once")
        if self.attach:
            self._run = AttachedRun(self.attach, self.config.curve_keys,
                                    ready_timeout=self.ready_timeout)
        else:
            self._run = OwnRun(self.config, self._own_specs(), ready_timeout=self.ready_timeout,
                               log_level=self.log_level)
        try:
            self._loop.start(self._run.serve)
        except BaseException:
            self.stop()
            raise
        self.helpers = ConsoleHelpers(self, self._run)
        self.namespace = build_namespace(self, self.helpers)
        return self

    def _own_specs(self) -> list[ActorSpec]:
        specs = self._specs
        if specs is None:
            # imported here: tests with small actors and attached consoles do not need it; the
            # checkpoint is written (torch) in a child, so the rollout manager loads no torch
            from replayrl.tools.run.launcher import actor_specs, resolved_initial_checkpoint
            output = Path(self.config.output_dir)
            output.mkdir(parents=True, exist_ok=True)
            (output / "config.json").write_text(self.config.to_json())
            checkpoint, resolved = resolved_initial_checkpoint(self.config, output)
            specs = actor_specs(self.config, checkpoint, resolved=resolved)
        return list(specs)

    def stop(self) -> None:
        """Leave: stop every actor of an own run, or detach from an attached one; joins the
        loop thread and removes an own run's ipc directory (idempotent)."""
        self._loop.stop()
        if isinstance(self._run, OwnRun):
            self._run.remove_run_dir()

    # -- the run's parts ---------------------------------------------------------------------
    @property
    def specs(self) -> list[ActorSpec]:
        """The specs of a session's own actors (empty before :meth:`start` and attached)."""
        return self._run.specs if isinstance(self._run, OwnRun) else []

    @property
    def supervisor(self) -> Supervisor | None:
        """The :class:`replayrl.actors.Supervisor` of a session's own actors (None attached)."""
        return self._run.supervisor if isinstance(self._run, OwnRun) else None

    @property
    def run_dir(self) -> Path | None:
        """The ipc directory of a session's own run (None attached)."""
        return self._run.run_dir if isinstance(self._run, OwnRun) else None

    @property
    def target(self) -> AttachTarget | None:
        """The run an attached session found (None for own actors)."""
        return self._run.target if isinstance(self._run, AttachedRun) else None

    @property
    def directory(self) -> Directory | None:
        """The run's :class:`replayrl.actors.Directory` (None before it is known)."""
        return self._run.directory if self._run is not None else None

    @property
    def processes(self) -> dict[str, Any]:
        """The supervisor's process objects (:class:`replayrl.actors.child_process.ChildProcess`),
        by actor name (none attached)."""
        return self._run.processes if isinstance(self._run, OwnRun) else {}

    # -- calls -------------------------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the session's loop and block until it finishes; return its result.

        On a session's own actors the coroutine races the supervisor's watch, so an actor
        process that dies ends the wait with :class:`replayrl.actors.ActorDied` instead of a timeout
        (attached, a lost peer fails the call with :class:`replayrl.actors.errors.PeerLost`).
        Ctrl-C (KeyboardInterrupt) cancels
        the coroutine on the loop before propagating.

        Raises:
            SessionClosed: the session is not running.
            whatever ``coro`` raises (e.g. :class:`replayrl.actors.RemoteError`, :class:`replayrl.actors.ActorTimeout`).
        """
        if self._run is None:
            coro.close()
            raise SessionClosed("the REPL session is closed; no actor is running")
        return self._loop.run(coro, self._run.guard)

    def call(self, name: str, method: str, *args: Any, timeout: float | None = DEFAULT_CALL_TIMEOUT,
             **kwargs: Any) -> Any:
        """Blocking ``await directory.proxy(name, timeout).<method>(*args, **kwargs)``.

        Args:
            timeout: seconds to wait for the reply; ``None`` waits forever (Ctrl-C still cancels).
        Raises:
            replayrl.actors.UnknownActor: no actor named ``name``.
            replayrl.actors.ActorCallError: no such method, or the arguments do not fit its signature
                (nothing was sent).
            replayrl.actors.RemoteError: the remote method raised (remote traceback attached).
            replayrl.actors.ActorTimeout: no reply within ``timeout`` seconds.
            replayrl.actors.ActorDied: an actor process of the run exited.
            SessionClosed: the session is not running.
        """
        directory = self._directory()
        if method.startswith("__"):  # a built-in (__ping__, __interface__): not in the interface
            return self.run(directory.ref(name).call(method, *args, timeout=timeout, **kwargs))
        return self.run(getattr(directory.proxy(name, timeout), method)(*args, **kwargs))

    def tell(self, name: str, method: str, *args: Any, **kwargs: Any) -> None:
        """Fire-and-forget ``method`` on ``name`` (sent from the loop; no reply, no error back).

        Raises:
            replayrl.actors.UnknownActor: no actor named ``name``.
            replayrl.actors.ActorCallError: no such method, or the arguments do not fit its signature
                (nothing was sent).
            SessionClosed: the session is not running.
        """
        proxy = self._directory().proxy(name, self.call_timeout)

        async def send() -> None:
            (await proxy.interface()).check_call(method, args, kwargs)
            proxy.ref.tell(method, *args, **kwargs)

        self.run(send())

    def step(self, k: int, timeout: float | None = DEFAULT_STEP_TIMEOUT) -> dict:
        """One iteration of :func:`replayrl.tools.run.train_loop.train_loop`, without the overlap.

        Generates rollout ``k`` on the engines, trains one optimizer step on it and pushes the
        new weights to every engine (nothing after a step the trainer skipped, ``skipped: 1``).
        The engines must already hold weights (``trainer.push_weights()`` once after start).

        Args:
            k: rollout id (each id is generated and taken once).
            timeout: seconds each of the three calls may take; ``None`` waits forever.
        Returns:
            The metrics row ``train_loop`` would record (:func:`replayrl.tools.run.train_loop.step_metrics`):
            ``step`` (= ``k``), the generation summary (without ``policy_versions``), the
            trainer's metrics (``trainer_version``, ``loss_tokens``, ...),
            ``weight_push_seconds``, ``weight_push_bytes`` (bytes) and ``step_seconds`` (wall
            seconds of the whole step).
        Raises:
            replayrl.actors.RemoteError: generation, training or the push failed (e.g. ``EngineNotReady``
                before the first push, ``RolloutError`` for a rollout id used twice).
            replayrl.actors.ActorTimeout / replayrl.actors.ActorDied / SessionClosed: as for :meth:`call`.
        """
        if self.attach:
            raise ReplError("step() drives a session's own actors; an attached run is stepped "
                            "by its own driver")
        directory = self._directory()
        manager, trainer = directory.proxy(MANAGER, timeout), directory.proxy("trainer", timeout)

        async def one_step() -> dict:
            start = time.perf_counter()
            summary, trained, push, _ = await sync_step(manager, trainer, k)  # no push if skipped
            return step_metrics(k, summary, trained, push, time.perf_counter() - start)

        row = self.run(one_step())
        self.rows.append(row)
        return row

    def interface(self, name: str):
        """The :class:`replayrl.actors.ActorInterface` of actor ``name`` (methods, signatures, docstrings).

        Raises:
            replayrl.actors.UnknownActor, replayrl.actors.ActorTimeout, SessionClosed: as :meth:`call`.
        """
        return self.run(self._directory().proxy(name, self.call_timeout).interface())

    def names(self) -> list[str]:
        """The names of the run's actors.

        Raises:
            SessionClosed: the session is not running.
        """
        return self._directory().names()

    def _directory(self) -> Directory:
        if self.directory is None or not self._loop.open:
            raise SessionClosed("the REPL session is closed; no actor is running")
        return self.directory


def main(args) -> int:
    """Entry point of ``replayrl repl``: start the run's actors (or attach to a running run's)
    and open a console on them.

    Args:
        args: the parsed ``repl`` flags (see :func:`replayrl.tools.run.flags.add_run_flags`) and
            ``--attach`` (a running run's output directory or one actor's address).
    Returns:
        Exit code: 0 on Ctrl-D / ``exit()`` (or the code given to ``exit(n)``), 1 when the actors
        failed to start or the run to attach to does not answer, 2 on a configuration error,
        130 on Ctrl-C during start.
    """
    def run() -> int:
        config = config_from_args(args)
        attach = getattr(args, "attach", "")
        if attach:
            print(f"replayrl repl: attaching to {attach} ...", file=sys.stderr)
        else:
            print(f"replayrl repl: starting {config.num_engines + 3} actors ...", file=sys.stderr)
        session = ReplSession(config, attach=attach)
        session.start()  # stops what it started before raising
        try:
            where = f"attached to {attach}" if attach else "own actors"
            banner = (f"{session.namespace['help_text']}\n\n{where}; actors: "
                      + ", ".join(session.namespace["actors"]))
            leave = ("replayrl repl: detaching; the run goes on" if attach
                     else "replayrl repl: stopping every actor")
            Console(session.namespace).interact(banner=banner, exitmsg=leave)
            return 0
        except SystemExit as exc:  # exit() / quit() inside the console
            if exc.code is None:
                return 0
            return exc.code if isinstance(exc.code, int) else 1
        finally:
            session.stop()

    # the console catches Ctrl-C (and would catch a SIGTERM raised as Terminated), so only the
    # start can end in 1 / 130; SIGTERM keeps its default action here
    return exit_code(run, failure="could not attach" if getattr(args, "attach", "")
                     else "actors failed to start")
