"""What to start: an actor's :class:`ActorSpec` (class, arguments, environment, CPUs, the process
it shares) and the grouping of specs into processes (docs/design/actors.md#colocate)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ActorSpec:
    """What to start: ``cls`` as ``"package.module:ClassName"`` built with ``kwargs``.

    ``kwargs`` must be picklable (they cross the process boundary once, at start). ``cpus``:
    the CPU ids the process may run on (``os.sched_setaffinity``, set before the actor class is
    imported, so thread pools inherit it); empty = the parent's. ``process``: the process the
    actor runs in; specs whose ``process`` (or, where empty, name) is equal share one process:
    their actors are built in spec order and served in one event loop, each under its own name
    and endpoint (docs/design/actors.md#colocate); they must agree on ``cpus`` and on every ``env``
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
