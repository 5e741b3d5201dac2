"""The array bundle of a push, built from tensors into buffers the caller allocates; loaded back.

What the zmq and shm syncs share: :func:`pack_tensors` copies the tensors of a push into one
1-D numpy buffer per dtype (``replayrl.transport.array_bundle``'s layout, the form the engine
actor has always received), each buffer made by the sync's ``allocate`` (ordinary memory, or a
send buffer of the shared-memory pool); :func:`load_bundle` is the engine half of both.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch

from replayrl.transport.array_bundle import unpack_arrays

__all__ = ["Allocate", "bundle_nbytes", "load_bundle", "pack_tensors"]

Allocate = Callable[[int, np.dtype], np.ndarray]
"""``allocate(size, dtype)`` -> a writable 1-D numpy array of ``size`` elements of ``dtype``."""


def _numpy_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype ``t`` is packed in: its own, or float32 for bfloat16 (numpy has none; the
    engines widen bf16 to float32 anyway, exactly)."""
    return torch.float32 if t.dtype == torch.bfloat16 else t.dtype


def pack_tensors(tensors: Mapping[str, torch.Tensor], allocate: Allocate) -> dict[str, Any]:
    """Copy ``tensors`` into one 1-D buffer per dtype made by ``allocate``, in ``tensors`` order.

    Args:
        tensors: HF name -> tensor of any shape, on any device (a CUDA tensor is concatenated
            on its device, then copied to the host buffer once).
        allocate: makes each buffer (:data:`Allocate`).
    Returns:
        the bundle ``{"buffers": [...], "entries": [[name, buffer, offset, shape], ...]}``
        (``replayrl.transport.array_bundle``), its buffers read-only.
    Raises:
        TypeError: a value is not a torch tensor.
    """
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    entries = []
    sizes: dict[torch.dtype, int] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pack_tensors: {name!r} is a {type(t).__name__}, not a torch tensor")
        dtype = _numpy_dtype(t)
        parts = groups.setdefault(dtype, [])
        offset = sizes.get(dtype, 0)
        sizes[dtype] = offset + t.numel()
        parts.append(t.detach().reshape(-1).to(dtype))
        entries.append([name, list(groups).index(dtype), offset, [int(d) for d in t.shape]])
    buffers = []
    with torch.no_grad():
        for dtype, parts in groups.items():
            buffer = allocate(sizes[dtype], torch.empty((), dtype=dtype).numpy().dtype)
            out = torch.from_numpy(buffer)
            if all(p.device.type == "cpu" for p in parts):
                torch.cat(parts, out=out)
            else:  # concatenated on the device, then one copy to the host buffer
                out.copy_(torch.cat([p.to(parts[0].device) for p in parts]))
            buffer.flags.writeable = False
            buffers.append(buffer)
    return {"buffers": buffers, "entries": entries}


def bundle_nbytes(bundle: Mapping[str, Any]) -> int:
    """Bytes of a bundle's buffers."""
    return int(sum(b.nbytes for b in bundle["buffers"]))


def load_bundle(engine: Any, bundle: Mapping[str, Any], version: int) -> None:
    """Load an array bundle into ``engine`` (``Engine.load_weights``) as policy ``version``.

    Raises:
        replayrl.transport.DecodeError: a malformed bundle (nothing loaded).
        Whatever the engine's load raises (its previous weights stay).
    """
    engine.load_weights(unpack_arrays(bundle), version=version)
