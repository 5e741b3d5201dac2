"""The ipc weight sync: CUDA IPC handles of the weights, for engines on the trainer's GPU.

The trainer copies the pushed tensors into one flat CUDA buffer per dtype (so it may train on)
and sends each engine the buffers' CUDA IPC handles (``torch.multiprocessing``'s reductions,
pickled): an engine on the same node and the same device maps them and copies the weights
device to device, and nothing crosses the host. CUDA only: a push of CPU tensors is refused
here, and ``--weight-sync ipc`` on the CPU is refused before any process starts
(:mod:`replayrl.rollout.weight_sync.run_check`). The buffers stay alive until every engine
loaded the push (``Packed.keep``).
"""
from __future__ import annotations

import pickle
from typing import Any, Mapping

import torch

from replayrl.rollout.errors import WeightSyncError
from replayrl.rollout.weight_sync.base import Packed, WeightHome, WeightSync, manifest

__all__ = ["IpcSync"]


class IpcSync(WeightSync):
    """CUDA IPC handles of the pushed tensors (``--weight-sync ipc``)."""

    name = "ipc"

    def pack(self, tensors: Mapping[str, torch.Tensor], *, version: int,
             home: WeightHome | None = None) -> Packed:
        """See :meth:`WeightSync.pack`: one flat CUDA buffer per dtype, the payload the pickled
        handles of their views (``{"tensors": bytes}``); ``keep``: the buffers.

        Raises:
            WeightSyncError: a tensor that is not on a CUDA device (names it).
        """
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions)

        off_gpu = [name for name, t in tensors.items() if t.device.type != "cuda"]
        if off_gpu:
            raise WeightSyncError(f"weight sync 'ipc' shares CUDA memory, but {off_gpu[0]!r} "
                                  f"(and {len(off_gpu) - 1} more) lie on the CPU; use "
                                  f"--weight-sync shm or zmq on the CPU")
        groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
        for name, t in tensors.items():
            groups.setdefault((t.dtype, t.device), []).append(name)
        views: dict[str, torch.Tensor] = {}
        buffers = []
        with torch.no_grad():
            for names in groups.values():
                flat = torch.cat([tensors[n].detach().reshape(-1) for n in names])
                buffers.append(flat)
                offset = 0
                for n in names:
                    size = tensors[n].numel()
                    views[n] = flat[offset:offset + size].view(tensors[n].shape)
                    offset += size
        handles = bytes(ForkingPickler.dumps(views))
        return Packed(manifest(self.name, tensors=handles),
                      int(sum(b.numel() * b.element_size() for b in buffers)), keep=buffers)

    def load(self, engine: Any, received: Any, version: int) -> None:
        """See :meth:`WeightSync.load`: the tensors mapped from their handles (on this node's
        GPU the trainer pushed from), copied into the engine by its own load.

        Raises:
            WeightSyncError: not an ipc manifest.
        """
        if not isinstance(received, Mapping) or not isinstance(received.get("tensors"), bytes):
            raise WeightSyncError("weight sync 'ipc': expected a manifest with the pickled "
                                  "CUDA handles under 'tensors'")
        import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions)

        tensors = pickle.loads(received["tensors"])  # noqa: S301  (from the run's own trainer)
        engine.load_weights(tensors, version=version)
