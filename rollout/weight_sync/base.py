"""The weight-sync interface: pack a push on the trainer, deliver it, load it on the engine.

One :class:`WeightSync` subclass is one way of moving the weights. Its trainer half runs in
trainer rank 0's process (``replayrl.trainer.ranks.trainer_actor.TrainerActor``):

1. :meth:`WeightSync.pack` turns the tensors of a push (HF name -> tensor, from
   ``TrainerBackend.push_tensors``) into a :class:`Packed`: the *payload* every engine's
   ``load_weights(version, payload)`` call carries (an array bundle, or a small manifest that
   names its sync under :data:`MANIFEST_KEY`) and what must stay alive until the engines loaded it;
2. :meth:`WeightSync.deliver` starts one ``load_weights`` call per engine and, for a sync that
   moves the data itself (dist: the broadcast), that transfer: a :class:`Delivery`.

Its engine half runs in the engine actor's process (``replayrl.rollout.dispatch.engine_actor``):
:meth:`WeightSync.receive` gets the data (dist: takes part in the broadcast, before any version
pin is waited for) and :meth:`WeightSync.load` puts it into the engine at the push's version.
The engine actor finds the sync of a payload with :func:`sync_name`, so a restarted engine's
bundle (``push_weights_to``) loads under any ``--weight-sync``.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Collection, Mapping, Protocol, Sequence

from replayrl.rollout.errors import WeightSyncError

if TYPE_CHECKING:
    import torch

    from replayrl.actors.proxy import ActorProxy

__all__ = ["MANIFEST_KEY", "Delivery", "Packed", "WeightHome", "WeightSync", "manifest", "sync_name"]

MANIFEST_KEY = "weight_sync"
"""The key under which a payload that is not an array bundle names its weight sync."""

_BUNDLE_KEYS = frozenset({"buffers", "entries"})  # replayrl.transport.array_bundle's layout


def manifest(name: str, **fields: Any) -> dict[str, Any]:
    """The payload of weight sync ``name`` that is not an array bundle: ``fields`` (plain
    msgpack-able data) plus ``{MANIFEST_KEY: name}``."""
    return {MANIFEST_KEY: name, **fields}


def sync_name(payload: Any) -> str:
    """The weight sync that packed ``payload``: ``"zmq"`` for an array bundle (the zmq and shm
    syncs load it alike), else the name the manifest carries.

    Raises:
        WeightSyncError: neither a bundle nor a manifest (names what it got).
    """
    if isinstance(payload, Mapping):
        if set(payload) == _BUNDLE_KEYS:
            return "zmq"
        name = payload.get(MANIFEST_KEY)
        if isinstance(name, str):
            return name
    shown = sorted(payload) if isinstance(payload, Mapping) else type(payload).__name__
    raise WeightSyncError(f"a weight push must be an array bundle or a manifest naming its "
                          f"weight sync under {MANIFEST_KEY!r}, got {shown}")


@dataclass
class Packed:
    """One push, packed on the trainer.

    Attributes:
        payload: what every engine's ``load_weights(version, payload)`` call carries.
        nbytes: bytes of weights the push moves (the ``weight_push_bytes`` metric).
        keep: whatever must stay alive until every engine loaded the push (a bucket the
            broadcast reads, the CUDA memory IPC handles point at); dropped after.
        frames: carry the payload's arrays as ZeroMQ frames, never through the shared-memory
            pool (the zmq sync).
    """

    payload: Any
    nbytes: int
    keep: Any = None
    frames: bool = False


@dataclass
class Delivery:
    """A push on its way.

    Attributes:
        loads: engine name -> its ``load_weights`` call (a future of the engine's reply).
        transfer: the sync's own transfer of the data (dist: the broadcast from this process),
            a future that raises if it failed; None for a sync whose calls carry the data.
    """

    loads: dict[str, asyncio.Future]
    transfer: asyncio.Future | None = None


class WeightHome(Protocol):
    """Where a trainer backend keeps its weights, for a sync that moves them into its own buffer
    so a push copies nothing (the shm sync's live path). ``TrainerBackend`` implements it."""

    def movable_weights(self) -> "dict[str, torch.Tensor] | None":
        """The weights in push order when they can live in one flat float32 CPU buffer, else
        None."""

    def move_weights(self, flat: "torch.Tensor") -> None:
        """Point every weight of :meth:`movable_weights` at its slice of ``flat`` (values
        copied)."""

    def before_weight_change(self, hook: "Callable[[], None] | None") -> None:
        """Call ``hook()`` before each write of the weights (optimizer step, checkpoint load)."""


EngineProxy = Callable[[str], "ActorProxy"]
"""Engine actor name -> a typed proxy to it (with the run's reply timeout)."""


class WeightSync(ABC):
    """One way a weight push reaches the engines; its trainer half and its engine half.

    Constructed once per process: on trainer rank 0 with the run's settings for this sync
    (plain data from the launcher, e.g. ``directory`` for disk, ``bucket_bytes`` for dist), in
    each engine actor without any (what an engine needs travels in the payload).

    Attributes:
        name: the registry name (``--weight-sync``).
        collective: whether a push must reach every engine of the run at once (one broadcast
            to a group), so a single engine (a restarted one) is brought up to date another
            way (``TrainerActor.push_weights_to``: the zmq sync).
    """

    name: ClassVar[str] = ""
    collective: ClassVar[bool] = False

    def __init__(self, **settings: Any) -> None:
        self.settings = settings

    # -- trainer side ------------------------------------------------------------------------

    @abstractmethod
    def pack(self, tensors: "Mapping[str, torch.Tensor]", *, version: int,
             home: WeightHome | None = None) -> Packed:
        """Pack the push of policy ``version``.

        Args:
            tensors: HF name -> floating tensor on the backend's device, in push order; they
                may be views of the live weights, so the pack copies what it keeps unless the
                sync owns where they live (``home``).
            home: the backend's weights, for a sync that moves them (:class:`WeightHome`).
        Raises:
            WeightSyncError: the tensors cannot go this way (names the sync and why).
        """

    async def deliver(self, packed: Packed, version: int, engines: Sequence[str],
                      proxy: EngineProxy, lost: Collection[str] = ()) -> Delivery:
        """Start the push to ``engines``: by default one ``load_weights(version, payload)``
        call each (``lost``, the engines known lost, are called too: their calls fail with
        ``PeerLost``, which the caller's ``--engine-failure`` policy judges)."""
        def call(engine: str) -> asyncio.Future:
            p = proxy(engine)
            return asyncio.ensure_future((p.without_shared_memory() if packed.frames else p)
                                         .load_weights(version, packed.payload))

        return Delivery({e: call(e) for e in engines})

    def close(self) -> None:  # noqa: B027  (an optional hook)
        """Release what the trainer half holds (a process group, files); idempotent."""

    # -- engine side -------------------------------------------------------------------------

    async def join(self, engine: Any, spec: Mapping[str, Any]) -> None:
        """Set up the receiving end of this sync (dist: join the trainer's group).

        Raises:
            WeightSyncError: this sync has no receiving end to set up.
        """
        raise WeightSyncError(f"weight sync {self.name!r} has no group to join")

    async def receive(self, engine: Any, payload: Any) -> Any:
        """Get the push's data in the engine's process, before the load waits for version pins
        (dist: take part in the broadcast); returns what :meth:`load` takes. By default the
        payload itself."""
        return payload

    @abstractmethod
    def load(self, engine: Any, received: Any, version: int) -> None:
        """Load what :meth:`receive` returned into ``engine`` (a
        ``replayrl.rollout.engines.base.Engine``) as policy ``version``.

        Raises:
            WeightSyncError: a payload of another sync or group.
            Whatever the engine's load raises (its previous weights stay).
        """

    def leave(self) -> None:  # noqa: B027  (an optional hook)
        """Release what the engine half holds (a process group); idempotent."""
