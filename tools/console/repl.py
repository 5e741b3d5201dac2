"""``replayrl repl``: an interactive Python console on the live actors of a run.

Two ways in (docs/design.md#attach-and-multi-host):

* ``replayrl repl [run flags]`` starts the run's actors exactly as ``replayrl train`` starts
  them (one process each, under a :class:`replayrl.actors.Supervisor`), but nothing drives the loop: the
  user does, one call (or ``step(k)``) at a time. Leaving stops every actor.
* ``replayrl repl --attach OUTPUT_DIR`` (the run's ``attach.json``, :mod:`replayrl.tools.run.attach_card``) or
  ``--attach tcp://host:port --curve-keys DIR`` (any one actor's address) joins a run that a
  launcher drives. The console is one more client of the actors: it starts, stops and steps
  nothing; leaving closes only its own connections (and resumes generation if this console
  paused it), so the run goes on as if no one had looked.

The actor runtime is asyncio and a connection belongs to the event loop that opened it, so the
session runs one event loop in a background thread and the console (main thread,
:class:`replayrl.tools.console.prompt.Console`) hands every call to it with
:func:`asyncio.run_coroutine_threadsafe`, blocking until the reply.

Console namespace (see :data:`HELP_TEXT`): ``actors`` (name -> :class:`ConsoleProxy`), one
variable per actor (``version_clock``, ``rollout_manager``, ``engine_0``, ``trainer``, ...),
``methods``, ``clock``, ``metrics``, ``sample``, ``pause``, ``resume``, ``call``, ``tell``,
``config``, ``help_text`` and, on a session's own actors, ``step``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shutil
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Coroutine

from replayrl.actors import (ActorError, ActorSpec, Directory, Supervisor, close_connections,
                    run_event_loop)
from replayrl.actors.run_dir import create_run_dir
from replayrl.tools.run.attach_card import AttachTarget, resolve_attach
from replayrl.tools.run.config import RunConfig, config_from_args
from replayrl.tools.run.exit_codes import exit_code
from replayrl.tools.console.prompt import Console
from replayrl.tools.console.views import Shown, methods_text, metrics_rows, metrics_text, sample_text
from replayrl.tools.errors import ReplError, SessionClosed
from replayrl.tools.run.train_loop import step_metrics, sync_step

log = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT = 60.0
"""Seconds a proxied call (``trainer.state()``, ``call(...)``) waits for its reply by default."""

DEFAULT_STEP_TIMEOUT = 600.0
"""Seconds each of ``step``'s three calls (generate, train, push) may take."""

_STOP_JOIN_SECONDS = 60.0  # shutdown: polite stop (<= 2.5 s) + joins (<= 7 s) + margin

HELP_TEXT = """\
replayrl repl: the run's actors are live; every call blocks until the actor replies.

  actors                       dict name -> proxy of every actor of the run
  methods(name=None)           each actor's methods: signatures and docstrings
  trainer.push_weights         (no call) one method's signature and docstring
  version_clock.state()        any public async method of an actor, called by attribute
                               (a proxy call waits {call_timeout:g} s; for longer ones use call)
  clock()                      the version clock (trainer / engine versions, window) and
                               whether generation is paused
  metrics(n=5, keys=None)      the last n metrics rows ({metrics_source})
  sample(rows=4)               the last generated sample: ids, reward, version and its traces
  pause(wait=True)             hold generation (engine requests not yet sent wait; with wait,
                               return once the engines are idle); versions stay exact
  resume()                     let generation go on
  call(name, method, *args, timeout={call_timeout:g}, **kw)   one call; timeout=None waits forever
  tell(name, method, *args, **kw)   fire-and-forget (remote errors are only logged by the actor)
{mode_lines}
  config                       the RunConfig of this session
  help_text                    this text
Helpers that print return a value whose .value holds the data.

A remote failure raises replayrl.actors.RemoteError carrying the actor's traceback; an actor process
that dies makes every later call raise replayrl.actors.ActorDied (attached: replayrl.actors.PeerLost).
Ctrl-C cancels the call in flight. {leave_line}"""

_OWN_LINES = """\
  step(k)                      one loop iteration as in tools/run/train_loop.py:
                               generate rollout k, train on it, push the new weights; returns
                               the merged metrics (trainer.push_weights() once first: engines
                               serve nothing before their first weight load)"""
_ATTACHED_LINES = """\
  (attached: the run's own driver steps it; this console starts, stops and steps nothing)"""
_OWN_LEAVE = "Ctrl-D or exit() stops every actor and leaves the console."
_ATTACHED_LEAVE = ("Ctrl-D or exit() detaches: the run goes on (generation is resumed first "
                   "if this console paused it).")

MANAGER = "rollout_manager"
"""The actor whose gate pauses generation (``RolloutManager.pause_generation``)."""
CLOCK = "version_clock"


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

    Args:
        config: the run's configuration (``config.transport`` picks ipc or tcp endpoints; when
            attaching, ``config.curve_keys`` are the keys for a tcp address).
        specs: actor specs replacing :func:`replayrl.tools.run.launcher.actor_specs` (tests use small actors).
        attach: a running run's output directory, attach card or one actor's address.
        call_timeout: default reply timeout of proxied calls, in seconds.
        ready_timeout: seconds every actor gets to answer its first ping.
        log_level: logging level inside the actor processes.
    """

    def __init__(self, config: RunConfig, specs: list[ActorSpec] | None = None, *,
                 attach: str = "", call_timeout: float = DEFAULT_CALL_TIMEOUT,
                 ready_timeout: float = 120.0, log_level: int = logging.WARNING) -> None:
        if attach and specs is not None:
            raise ReplError("an attached session starts no actors: give specs or attach, not both")
        self.config = config
        self.attach = attach
        self.call_timeout = call_timeout
        self.ready_timeout = ready_timeout
        self.log_level = log_level
        self._specs = specs
        self.specs: list[ActorSpec] = []
        self.target: AttachTarget | None = None
        self.directory: Directory | None = None
        self.supervisor: Supervisor | None = None
        self.run_dir: Path | None = None
        self.namespace: dict[str, Any] = {}
        self.rows: list[dict] = []  # step() results of a session's own run
        self._paused_here = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_event: asyncio.Event | None = None
        self._watch: asyncio.Future | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._open = False

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
        if self._thread is not None:
            raise ReplError("a ReplSession can be started once")
        if not self.attach:
            self._prepare_own()
        serve = self._serve_attached() if self.attach else self._serve_own()
        self._thread = threading.Thread(target=run_event_loop, args=(serve,),
                                        name="replayrl-repl-loop", daemon=True)
        try:
            self._thread.start()
            self._ready.wait()  # set on success and on failure; Ctrl-C lands in the except
            if self._start_error is not None:
                raise self._start_error
        except BaseException:
            self.stop()
            raise
        self._open = True
        self.namespace = self._build_namespace()
        return self

    def _prepare_own(self) -> None:
        specs = self._specs
        if specs is None:
            # imported here: the launcher pulls in the model (torch), which tests with small
            # actors and attached consoles do not need
            from replayrl.tools.run.launcher import actor_specs, initial_checkpoint
            output = Path(self.config.output_dir)
            output.mkdir(parents=True, exist_ok=True)
            (output / "config.json").write_text(self.config.to_json())
            specs = actor_specs(self.config, initial_checkpoint(self.config, output))
        self.specs = list(specs)
        self.run_dir = create_run_dir()  # short path: AF_UNIX limit; stale ones are removed
        self.directory = Directory.for_run(self.run_dir, [s.name for s in self.specs],
                                           self.config.transport, curve_keys=self.config.curve_keys)

    async def _serve_own(self) -> None:
        """The background loop's one coroutine: run the supervisor until :meth:`stop`."""
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        try:
            supervisor = Supervisor(self.specs, self.directory, self.run_dir,
                                    ready_timeout=self.ready_timeout, log_level=self.log_level,
                                    run_name=str(self.config.output_dir))
            self.supervisor = supervisor
            async with supervisor:
                self._watch = asyncio.ensure_future(supervisor.watch())
                self._watch.add_done_callback(_consume_exception)
                self._ready.set()
                try:
                    await self._stop_event.wait()
                finally:
                    self._watch.cancel()
                    await asyncio.gather(self._watch, return_exceptions=True)
        except BaseException as exc:
            if not self._ready.is_set():
                self._start_error = exc
            else:
                log.error("repl: actor shutdown failed: %s: %s", type(exc).__name__, exc)
        finally:
            close_connections()  # sockets of this loop; the supervisor closes them too
            self._ready.set()

    async def _serve_attached(self) -> None:
        """The background loop's coroutine when attached: find the run, then only wait; on the
        way out undo this session's pause and close this process's connections."""
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        try:
            self.target = await resolve_attach(self.attach, self.config.curve_keys,
                                               timeout=min(self.ready_timeout, 10.0))
            self.directory = self.target.directory
            self._ready.set()
            await self._stop_event.wait()
            if self._paused_here:
                try:
                    await self.directory.proxy(MANAGER, 10.0).resume_generation()
                    print("replayrl repl: generation resumed (this console had paused it)",
                          file=sys.stderr)
                except ActorError as exc:
                    log.error("repl: could not resume generation on detach: %s", exc)
        except BaseException as exc:
            if not self._ready.is_set():
                self._start_error = exc
            else:
                log.error("repl: detach failed: %s: %s", type(exc).__name__, exc)
        finally:
            close_connections()  # this console's own sockets; the run's actors go on
            self._ready.set()

    def stop(self) -> None:
        """Leave: stop every actor of an own run, or detach from an attached one; joins the
        loop thread and removes an own run's ipc directory (idempotent)."""
        self._open = False
        thread, loop = self._thread, self._loop
        if thread is not None and thread.is_alive():
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._request_stop)
                except RuntimeError:  # the loop finished between the checks
                    pass
            # bounded by the supervisor's shutdown (polite stop, SIGTERM, SIGKILL); a second
            # Ctrl-C abandons the wait, and the actors then exit on their own once this process
            # is gone (they poll their parent)
            thread.join(_STOP_JOIN_SECONDS)
            if thread.is_alive():
                log.error("repl: event loop thread did not finish within %s s", _STOP_JOIN_SECONDS)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _request_stop(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()
        # a start still waiting for pings: cancel it (the supervisor shuts down on the way out)
        if not self._ready.is_set():
            for task in asyncio.all_tasks():
                task.cancel()

    @property
    def processes(self) -> dict[str, Any]:
        """The supervisor's ``multiprocessing`` process objects, by actor name (none attached)."""
        return dict(self.supervisor.processes) if self.supervisor is not None else {}

    # -- calls -------------------------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the session's loop and block until it finishes; return its result.

        On a session's own actors the coroutine races the supervisor's watch, so an actor
        process that dies ends the wait with :class:`replayrl.actors.ActorDied` instead of a timeout
        (attached, a lost peer fails the call with :class:`replayrl.actors.errors.PeerLost`). Ctrl-C (KeyboardInterrupt) cancels
        the coroutine on the loop before propagating.

        Raises:
            SessionClosed: the session is not running.
            whatever ``coro`` raises (e.g. :class:`replayrl.actors.RemoteError`, :class:`replayrl.actors.ActorTimeout`).
        """
        if not self._open or self._loop is None or self._loop.is_closed():
            coro.close()
            raise SessionClosed("the REPL session is closed; no actor is running")
        future = asyncio.run_coroutine_threadsafe(self._guarded(coro), self._loop)
        try:
            return future.result()  # the timeout is enforced on the loop, by ActorRef.call
        except concurrent.futures.CancelledError:
            raise SessionClosed("the REPL session closed during the call") from None
        except BaseException:
            future.cancel()  # Ctrl-C: do not leave the call running on the loop
            raise

    async def _guarded(self, coro: Coroutine[Any, Any, Any]) -> Any:
        task = asyncio.ensure_future(coro)
        watch = self._watch
        if watch is None:  # attached: no processes of ours to watch; a lost peer is PeerLost
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

    # -- views ---------------------------------------------------------------------------------
    def interface(self, name: str):
        """The :class:`replayrl.actors.ActorInterface` of actor ``name`` (methods, signatures, docstrings).

        Raises:
            replayrl.actors.UnknownActor, replayrl.actors.ActorTimeout, SessionClosed: as :meth:`call`.
        """
        return self.run(self._directory().proxy(name, self.call_timeout).interface())

    def methods(self, name: str | None = None, docs: bool = True) -> Shown:
        """Every actor's (or one actor's) methods: signature and the docstring's first paragraph.

        Returns:
            :class:`replayrl.tools.console.views.Shown`; ``.value`` maps actor name -> ActorInterface.
        Raises:
            replayrl.actors.UnknownActor: no actor named ``name``; as :meth:`call` otherwise.
        """
        names = [name] if name is not None else self._directory().names()
        interfaces = {n: self.interface(n) for n in names}
        return Shown("\n".join(methods_text(i, docs) for i in interfaces.values()), interfaces)

    def clock(self) -> dict:
        """The version clock's state (``trainer_version``, ``engine_versions``,
        ``max_staleness``) plus ``generation``: the rollout manager's gate (``paused``,
        ``in_flight``, ``held`` engine requests)."""
        state = self.call(CLOCK, "state", timeout=self.call_timeout)
        return {**state, "generation": self.call(MANAGER, "generation_status",
                                                 timeout=self.call_timeout)}

    def metrics(self, n: int = 5, keys: str | list[str] | None = None) -> Shown:
        """The last ``n`` metrics rows as a table of ``keys`` (one key as a ``str``, or a list;
        default :data:`replayrl.tools.console.views.METRIC_KEYS`): an attached run's ``metrics.jsonl``, or
        the rows :meth:`step` returned in a session's own run.

        Returns:
            :class:`replayrl.tools.console.views.Shown`; ``.value`` is the list of rows (dicts).
        Raises:
            ReplError: attached by an address, so the driver's ``metrics.jsonl`` is elsewhere
                (attach by the run's output directory), or the file is unreadable.
            replayrl.tools.console.views.MetricKeyError: a key of ``keys`` is in none of the rows shown.
        """
        if self.attach:
            output = self.target.output_dir if self.target is not None else ""
            if not output:
                raise ReplError(f"attached by address ({self.attach}): metrics.jsonl is on the "
                                f"driver's host; attach by the run's output directory instead")
            try:
                rows = metrics_rows(Path(output) / "metrics.jsonl", n)
            except FileNotFoundError:
                rows = []  # the run has not finished its first step
            except (OSError, ValueError) as exc:
                raise ReplError(f"metrics: {exc}") from None
        else:
            rows = self.rows[-n:] if n >= 1 else []
        return Shown(metrics_text(rows, keys or None), rows)

    def sample(self, rows: int = 4) -> Shown:
        """The last sample the rollout manager scored, with its traces (first ``rows`` rows of
        each): ``RolloutManager.last_sample``.

        Returns:
            :class:`replayrl.tools.console.views.Shown`; ``.value`` is the sample's columns.
        """
        columns = self.call(MANAGER, "last_sample", timeout=self.call_timeout)
        return Shown(sample_text(columns, rows), columns)

    def pause(self, wait: bool = True) -> dict:
        """Pause generation (``RolloutManager.pause_generation``); returns the gate's state. An
        attached console that paused resumes on leaving."""
        state = self.call(MANAGER, "pause_generation", wait,
                          timeout=None if wait else self.call_timeout)
        self._paused_here = True
        return state

    def resume(self) -> dict:
        """Resume generation (``RolloutManager.resume_generation``); returns the gate's state."""
        state = self.call(MANAGER, "resume_generation", timeout=self.call_timeout)
        self._paused_here = False
        return state

    def _directory(self) -> Directory:
        if self.directory is None or not self._open:
            raise SessionClosed("the REPL session is closed; no actor is running")
        return self.directory

    # -- console namespace -------------------------------------------------------------------
    def _build_namespace(self) -> dict[str, Any]:
        proxies = {n: ConsoleProxy(self, n) for n in self._directory().names()}
        helpers = dict(call=self.call, tell=self.tell, methods=self.methods, clock=self.clock,
                       metrics=self.metrics, sample=self.sample, pause=self.pause,
                       resume=self.resume)
        if not self.attach:
            helpers["step"] = self.step
        reserved = {"actors", "config", "help_text", "step", *helpers}
        namespace: dict[str, Any] = {n: p for n, p in proxies.items()
                                     if n.isidentifier() and n not in reserved}
        if self.attach:
            source = (f"{self.target.output_dir}/metrics.jsonl" if self.target.output_dir
                      else "attached by address: not available")
            mode, leave = _ATTACHED_LINES, _ATTACHED_LEAVE
        else:
            source, mode, leave = "the rows step() returned", _OWN_LINES, _OWN_LEAVE
        namespace.update(helpers, actors=proxies, config=self.config, help_text=HELP_TEXT.format(
            call_timeout=self.call_timeout, metrics_source=source, mode_lines=mode,
            leave_line=leave))
        return namespace


class ConsoleProxy:
    """Synchronous stand-in for one actor: ``proxy.method(*args, **kw)`` blocks for the reply.

    Each call goes through a typed :class:`replayrl.actors.ActorProxy`, so a misspelt method or a wrong
    argument list raises :class:`replayrl.actors.ActorCallError` with the signature before anything is
    sent. ``dir()`` and ``repr()`` show the actor's methods and signatures, asked from the actor
    itself (its ``__interface__``). ``__ping__`` is forwarded too; other ``_`` names are not.
    The reply timeout is the session's ``call_timeout``; ``call(...)`` in the console takes
    another.
    """

    __slots__ = ("_session", "_name")

    def __init__(self, session: ReplSession, name: str) -> None:
        self._session = session
        self._name = name

    def __getattr__(self, method: str) -> "ConsoleMethod":
        if method.startswith("_") and method != "__ping__":
            raise AttributeError(method)
        return ConsoleMethod(self, method)

    def _interface(self):
        try:
            return self._session.interface(self._name)
        except Exception:  # completion and repr only: never fail the console over it
            return None

    def __dir__(self) -> list[str]:
        interface = self._interface()
        return sorted(interface.texts) if interface is not None else []

    def __repr__(self) -> str:
        interface = self._interface()
        if interface is None:
            return f"<actor {self._name}; not answering>"
        return methods_text(interface, docs=False)


class ConsoleMethod:
    """One method of one actor; calling it blocks until the reply (see :class:`ConsoleProxy`);
    its ``repr`` is the signature and the whole docstring, asked from the actor."""

    __slots__ = ("_proxy", "_method")

    def __init__(self, proxy: ConsoleProxy, method: str) -> None:
        self._proxy = proxy
        self._method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        session = self._proxy._session
        return session.call(self._proxy._name, self._method, *args, timeout=session.call_timeout,
                            **kwargs)

    def __repr__(self) -> str:
        interface = self._proxy._interface()
        name = f"{self._proxy._name}.{self._method}"
        if interface is None or self._method not in interface.texts:
            return f"<remote method {name}>"
        doc = interface.docs.get(self._method, "")
        return f"{self._proxy._name}.{interface.texts[self._method]}" + (
            "\n" + textwrap.indent(doc, "    ") if doc else "")


def _consume_exception(future: asyncio.Future) -> None:
    # the watch's ActorDied is reported by the next call; keep asyncio from logging it as lost
    if not future.cancelled():
        future.exception()


def main(args) -> int:
    """Entry point of ``replayrl repl``: start the run's actors (or attach to a running run's)
    and open a console on them.

    Args:
        args: the parsed ``repl`` flags (see :func:`replayrl.tools.run.config.add_run_flags`) and
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
