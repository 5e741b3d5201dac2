"""An actor's callable interface as plain data, so a caller can check a call before sending it.

The server answers the built-in ``__interface__`` call with :func:`describe` of its actor class;
the caller rebuilds each method's :class:`inspect.Signature` from it (:class:`ActorInterface`)
and binds the call's arguments locally. A misspelt method or a wrong argument list then fails in
the caller's process, at the call site, with the actor's name and the method's signature,
instead of travelling to the other process as a string. The description is msgpack-plain data
(names, parameter kinds, signature text), so the caller imports nothing of the actor's module:
the import direction of the packages (``tools -> {rollout, trainer} -> actors``) holds.
"""
from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from replayrl.actors.errors import ActorCallError

# Lifecycle hooks of replayrl.actors.Actor: public names, but the runtime calls them, never a peer.
LIFECYCLE_HOOKS = frozenset({"on_start", "on_stop"})
RUNTIME_NAMES = LIFECYCLE_HOOKS | {"ref", "proxy", "name", "directory"}
"""Every public name of :class:`replayrl.actors.Actor` itself: the runtime's, never callable by a peer,
whatever a subclass overrides (a test keeps this equal to the class's public names)."""


def public_methods(cls: type) -> dict[str, Any]:
    """The remotely callable methods of an actor class: public ``async def`` methods, by name.

    Lifecycle hooks (``on_start`` / ``on_stop``) and the base class's other names
    (:data:`RUNTIME_NAMES`) are excluded: the runtime calls them.
    """
    return {name: fn for name, fn in inspect.getmembers(cls, inspect.iscoroutinefunction)
            if not name.startswith("_") and name not in RUNTIME_NAMES}


class _Annotation(str):
    """An annotation string shown as written (``int``, not ``'int'``) in signature text."""

    def __repr__(self) -> str:
        return str(self)


def _plain(annotation: Any) -> Any:
    # modules with `from __future__ import annotations` hold annotations as strings
    return _Annotation(annotation) if isinstance(annotation, str) else annotation


def describe(cls: type) -> dict:
    """The interface of actor class ``cls`` as msgpack-plain data.

    Returns:
        ``{"actor_class": str, "methods": {name: {"params": [[param name, kind name,
        has default], ...], "text": "name(a: int, *, b=1) -> dict", "doc": str}}}`` with
        ``self`` left out; kind names are :class:`inspect.Parameter` kinds
        (``"POSITIONAL_OR_KEYWORD"``, ...); ``doc`` is the method's docstring, cleaned by
        :func:`inspect.getdoc` (``""`` when it has none), for consoles that list the methods.
    """
    methods = {}
    for name, fn in public_methods(cls).items():
        signature = inspect.signature(fn)
        params = list(signature.parameters.values())[1:]  # drop self
        text = str(signature.replace(
            parameters=[p.replace(annotation=_plain(p.annotation)) for p in params],
            return_annotation=_plain(signature.return_annotation)))
        methods[name] = {"params": [[p.name, p.kind.name, p.default is not p.empty] for p in params],
                         "text": f"{name}{text}", "doc": inspect.getdoc(fn) or ""}
    return {"actor_class": cls.__name__, "methods": methods}


@dataclass(frozen=True)
class ActorInterface:
    """The methods of one remote actor, rebuilt from :func:`describe` output.

    Attributes:
        actor: the actor's name in the run's directory.
        actor_class: its class name.
        signatures: method name -> :class:`inspect.Signature` (without ``self``).
        texts: method name -> signature text for messages (``"train(rollout_id: int) -> dict"``).
        docs: method name -> docstring (``""`` when the method has none, or the peer sent none).
    """

    actor: str
    actor_class: str
    signatures: Mapping[str, inspect.Signature]
    texts: Mapping[str, str]
    docs: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_description(cls, actor: str, description: dict) -> "ActorInterface":
        """Rebuild the signatures. Raises :class:`replayrl.actors.ProtocolError` on a malformed description."""
        from replayrl.actors.errors import ProtocolError

        try:
            signatures, texts, docs = {}, {}, {}
            for name, spec in description["methods"].items():
                signatures[name] = inspect.Signature([
                    inspect.Parameter(p, getattr(inspect.Parameter, kind),
                                      default=None if has_default else inspect.Parameter.empty)
                    for p, kind, has_default in spec["params"]])
                texts[name] = str(spec["text"])
                docs[name] = str(spec.get("doc", ""))
            return cls(actor, str(description["actor_class"]), MappingProxyType(signatures),
                       MappingProxyType(texts), MappingProxyType(docs))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"actor {actor!r} sent a malformed interface: "
                                f"{type(exc).__name__}: {exc}") from None

    def check_call(self, method: str, args: tuple, kwargs: dict) -> None:
        """Check that ``method(*args, **kwargs)`` fits the remote method's signature.

        Raises:
            ActorCallError: no such public method (the message names the closest methods,
                or lists them all when none is close), or the arguments do not bind (the
                message gives the signature).
        """
        signature = self.signatures.get(method)
        if signature is None:
            # a misspelling: the closest names, best first (difflib's similarity ratio >= 0.7:
            # one swapped or missing letter in a short name; 0.6, its default, also offered
            # 'echo' for 'recrod'), else every method
            close = [repr(m) for m in difflib.get_close_matches(method, self.signatures, n=3,
                                                                cutoff=0.7)]
            hint = (f"did you mean {' or '.join(close)}?" if close
                    else f"its methods: {', '.join(sorted(self.signatures))}")
            raise ActorCallError(f"actor {self.actor!r} ({self.actor_class}) has no method "
                                 f"{method!r}; {hint}")
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ActorCallError(f"{self.actor}.{self.texts[method]}: {exc}") from None
