"""The shm weight sync: the push in this process's shared-memory pool, carried to ipc engines by handle.

docs/design/transport.md#shm-transport. Two ways, chosen per push:

* **live path**: a backend whose weights can live in one flat float32 CPU buffer
  (``WeightHome.movable_weights``: the torch backend with one process, no LoRA) has them moved,
  at the first push, into a send buffer of the pool; from then on a push is that buffer itself,
  renewed (:func:`replayrl.transport.shm_pool.renew_buffer`) and sent with no copy and no buffer
  of its own. Before the weights next change (``WeightHome.before_weight_change``), if an engine
  may still read the last push out of them, they move to a fresh send buffer first (one copy),
  leaving the old one to the engine until it released it;
* otherwise the tensors are copied once into a send buffer (:func:`replayrl.actors.ref.send_buffer`:
  a slot when the pool has room, else ordinary memory), which the first engine's call carries by
  handle.

An engine whose endpoint is not ipc gets the same bundle as ZeroMQ frames (the transport's own
rule); the engine half is the zmq sync's (:func:`load_bundle`).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from replayrl.actors.ref import send_buffer, shared_memory_pool
from replayrl.rollout.weight_sync.base import Packed, WeightHome, WeightSync
from replayrl.rollout.weight_sync.bundle import bundle_nbytes, load_bundle, pack_tensors
from replayrl.transport.array_bundle import bundle_of_buffer
from replayrl.transport.shm_pool import buffer_in_use, renew_buffer

__all__ = ["ShmSync"]


class ShmSync(WeightSync):
    """Array bundle in shared memory, by handle to ipc engines (``--weight-sync shm``)."""

    name = "shm"

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self._slot: np.ndarray | None = None  # the send buffer the weights live in (live path)
        self._layout: list[tuple[str, tuple[int, ...]]] = []  # (name, shape) in buffer order
        self._home: WeightHome | None = None
        self._tried = False  # the live path is tried once, at the first push

    def pack(self, tensors: Mapping[str, torch.Tensor], *, version: int,
             home: WeightHome | None = None) -> Packed:
        """See :meth:`WeightSync.pack`: the weights' own send buffer (live path), or one copy
        into a send buffer."""
        if home is not None and not self._tried:
            self._tried = True
            self._adopt(home, tensors)
        if self._slot is not None and [n for n, _ in self._layout] == list(tensors):
            self._writable()
            if self._slot is not None:
                # the weights themselves are the push: no copy, no buffer
                # (docs/benchmarks.md#peer-grid); the first engine's call carries it by handle
                renew_buffer(self._slot)
                pushed = self._slot.view()
                pushed.flags.writeable = False
                return Packed(bundle_of_buffer(pushed, self._layout), pushed.nbytes)
        # built in a shared-memory slot when the pool has room: sending it to an engine then
        # copies nothing, and no buffer of the push's size waits beside the slot until the
        # engines loaded it (docs/benchmarks.md#peer-grid)
        bundle = pack_tensors(tensors, send_buffer)
        return Packed(bundle, bundle_nbytes(bundle))

    def _adopt(self, home: WeightHome, tensors: Mapping[str, torch.Tensor]) -> None:
        """Move the backend's weights into a send buffer when they can live there and the push
        is exactly them (not a LoRA push of adapters)."""
        movable = home.movable_weights()
        if movable is None or list(movable) != list(tensors):
            return
        numel = sum(t.numel() for t in movable.values())
        pool = shared_memory_pool()
        flat_u8 = pool.buffer(numel * 4) if pool is not None else None
        if flat_u8 is None:
            return
        buffer = flat_u8.view(np.float32)
        self._layout = [(name, tuple(t.shape)) for name, t in movable.items()]
        home.move_weights(torch.from_numpy(buffer))
        self._slot, self._home = buffer, home
        home.before_weight_change(self._writable)

    def _writable(self) -> None:
        """Before the weights change: if an engine may still read the last push out of them,
        move them to a fresh send buffer first (a copy), leaving the old one to the engine; the
        pool takes it back once released. When the pool has no room left they move to ordinary
        memory and later pushes copy (the weights are no longer shared)."""
        if self._slot is None or self._home is None or not buffer_in_use(self._slot):
            return
        numel = self._slot.size
        pool = shared_memory_pool()
        flat_u8 = pool.buffer(numel * 4) if pool is not None else None
        buffer = np.empty(numel, np.float32) if flat_u8 is None else flat_u8.view(np.float32)
        self._home.move_weights(torch.from_numpy(buffer))
        if flat_u8 is None:
            self._slot = None
            self._home.before_weight_change(None)
        else:
            self._slot = buffer

    def load(self, engine: Any, received: Any, version: int) -> None:
        """See :meth:`WeightSync.load`: the bundle's arrays, views of the sender's slot."""
        load_bundle(engine, received, version)
