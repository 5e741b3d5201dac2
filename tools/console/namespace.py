"""The console namespace of ``replayrl repl``: one synchronous proxy per actor, the helpers and
the help text (docs/design/multi-host.md#attach-and-multi-host).

Console namespace (see :data:`HELP_TEXT`): ``actors`` (name -> :class:`ConsoleProxy`), one
variable per actor (``version_clock``, ``rollout_manager``, ``engine_0``, ``trainer``, ...),
``methods``, ``clock``, ``metrics``, ``sample``, ``pause``, ``resume``, ``call``, ``tell``,
``config``, ``help_text`` and, on a session's own actors, ``step``.
"""
from __future__ import annotations

import textwrap
from typing import Any

from replayrl.tools.console.helpers import ConsoleHelpers
from replayrl.tools.console.views import methods_text

__all__ = ["HELP_TEXT", "ConsoleProxy", "ConsoleMethod", "build_namespace"]

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


def build_namespace(session: Any, helpers: ConsoleHelpers) -> dict[str, Any]:
    """The console's globals for a started ``session`` (a
    :class:`replayrl.tools.console.repl.ReplSession`): a :class:`ConsoleProxy` per actor
    (under ``actors``, and as a variable when its name is an identifier no helper uses), the
    helpers, ``config`` and ``help_text`` (``step`` only on a session's own actors).

    Raises:
        replayrl.tools.errors.SessionClosed: the session is not running.
    """
    proxies = {n: ConsoleProxy(session, n) for n in session.names()}
    functions = dict(call=session.call, tell=session.tell, methods=helpers.methods,
                     clock=helpers.clock, metrics=helpers.metrics, sample=helpers.sample,
                     pause=helpers.pause, resume=helpers.resume)
    if not session.attach:
        functions["step"] = session.step
    reserved = {"actors", "config", "help_text", "step", *functions}
    namespace: dict[str, Any] = {n: p for n, p in proxies.items()
                                 if n.isidentifier() and n not in reserved}
    if session.attach:
        source = (f"{session.target.output_dir}/metrics.jsonl" if session.target.output_dir
                  else "attached by address: not available")
        mode, leave = _ATTACHED_LINES, _ATTACHED_LEAVE
    else:
        source, mode, leave = "the rows step() returned", _OWN_LINES, _OWN_LEAVE
    namespace.update(functions, actors=proxies, config=session.config, help_text=HELP_TEXT.format(
        call_timeout=session.call_timeout, metrics_source=source, mode_lines=mode,
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

    Args:
        session: the :class:`replayrl.tools.console.repl.ReplSession` that makes the calls.
        name: the actor's name.
    """

    __slots__ = ("_session", "_name")

    def __init__(self, session: Any, name: str) -> None:
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
