"""The ipc weight sync: CUDA IPC handles of the weights, for engines on the trainer's GPU.

The trainer copies the pushed tensors into one flat CUDA buffer per dtype (so it may train on)
and sends each engine the buffers' CUDA IPC handles as plain data (what
``torch.multiprocessing.reductions.reduce_tensor`` shares, field by field: nothing on the wire
is pickled): an engine on the same node and device maps them
(``torch.multiprocessing.reductions.rebuild_cuda_tensor``) and copies the weights device to
device; nothing crosses the host. CUDA only: a push of CPU tensors is refused here, and
``--weight-sync ipc`` on the CPU is refused before any process starts
(:mod:`replayrl.rollout.weight_sync.run_check`). The buffers stay alive until every engine
loaded the push (``Packed.keep``). Not yet run on a GPU (docs/gpu.md).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from replayrl.rollout.errors import WeightSyncError
from replayrl.rollout.weight_sync.base import Packed, WeightHome, WeightSync, manifest

__all__ = ["IpcSync"]

_HANDLE_FIELDS = ("device", "handle", "storage_size", "storage_offset", "ref_counter_handle",
                  "ref_counter_offset", "event_handle", "event_sync_required")
"""The fields of ``UntypedStorage._share_cuda_()``, in its order."""


def _share(flat: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC handle of the 1-D contiguous ``flat`` as plain data."""
    from torch.multiprocessing.reductions import StorageWeakRef, shared_cache

    storage = flat._typed_storage()
    shared = storage._share_cuda_()
    shared_cache[shared[1]] = StorageWeakRef(storage)  # as reduce_tensor: the sender's cache
    return {"numel": flat.numel(), "offset": flat.storage_offset(),
            "dtype": str(flat.dtype).removeprefix("torch."),
            **{k: (bytes(v) if isinstance(v, (bytes, bytearray)) else v)
               for k, v in zip(_HANDLE_FIELDS, shared)}}


def _open(buffer: Mapping[str, Any]) -> torch.Tensor:
    """The 1-D CUDA tensor a :func:`_share` record points at, mapped in this process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([buffer["numel"]]), (1,), buffer["offset"],
        torch.storage.TypedStorage, getattr(torch, str(buffer["dtype"])), buffer["device"],
        buffer["handle"], buffer["storage_size"], buffer["storage_offset"], False,
        buffer["ref_counter_handle"], buffer["ref_counter_offset"], buffer["event_handle"],
        buffer["event_sync_required"])


class IpcSync(WeightSync):
    """CUDA IPC handles of the pushed tensors (``--weight-sync ipc``)."""

    name = "ipc"

    def pack(self, tensors: Mapping[str, torch.Tensor], *, version: int,
             home: WeightHome | None = None) -> Packed:
        """See :meth:`WeightSync.pack`: one flat CUDA buffer per dtype and device; the payload
        ``{"buffers": [handle records], "entries": [[name, buffer, offset, shape]]}`` (the
        array bundle's layout, buffers as handles); ``keep``: the buffers.

        Raises:
            WeightSyncError: a tensor that is not on a CUDA device (names it).
        """
        off_gpu = [name for name, t in tensors.items() if t.device.type != "cuda"]
        if off_gpu:
            raise WeightSyncError(f"weight sync 'ipc' shares CUDA memory, but {off_gpu[0]!r} "
                                  f"(and {len(off_gpu) - 1} more) lie on the CPU; use "
                                  f"--weight-sync shm or zmq on the CPU")
        groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
        for name, t in tensors.items():
            groups.setdefault((t.dtype, t.device), []).append(name)
        buffers, records, entries = [], [], []
        with torch.no_grad():
            for index, names in enumerate(groups.values()):
                flat = torch.cat([tensors[n].detach().reshape(-1) for n in names])
                buffers.append(flat)
                records.append(_share(flat))
                offset = 0
                for n in names:
                    entries.append([n, index, offset, [int(d) for d in tensors[n].shape]])
                    offset += tensors[n].numel()
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        return Packed(manifest(self.name, buffers=records, entries=entries), int(nbytes),
                      keep=buffers)

    def load(self, engine: Any, received: Any, version: int) -> None:
        """See :meth:`WeightSync.load`: the buffers mapped from their handles (the trainer's
        GPU, on this node), the tensors views of them, copied into the engine by its own load.

        Raises:
            WeightSyncError: not an ipc manifest, or an entry outside its buffer.
        """
        if not isinstance(received, Mapping) or not isinstance(received.get("buffers"), list) \
                or not isinstance(received.get("entries"), list):
            raise WeightSyncError("weight sync 'ipc': expected a manifest with 'buffers' (CUDA "
                                  "handles) and 'entries'")
        buffers = [_open(b) for b in received["buffers"]]
        tensors = {}
        for name, index, offset, shape in received["entries"]:
            size = math.prod(shape)
            if not 0 <= index < len(buffers) or offset + size > buffers[index].numel():
                raise WeightSyncError(f"weight sync 'ipc': {name!r} lies outside its buffer")
            tensors[name] = buffers[index][offset:offset + size].view(shape)
        engine.load_weights(tensors, version=version)
