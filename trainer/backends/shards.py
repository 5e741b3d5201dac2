"""A parameter as the torch backend's body sees it, whole or an FSDP2 shard (a ``DTensor``).

The torch backend runs the same body over a plain policy (one rank, DDP) and over one that
``fully_shard`` split over the ranks (the fsdp backend): each helper here gives a plain tensor
back as it is and translates a ``DTensor``. ``torch.distributed.tensor`` is never imported
here: in a process that has not imported it nothing is a ``DTensor``, and the one-process
trainer keeps the compiler stack it pulls in out of its memory
(tests/system/test_trainer_without_dynamo.py).
"""
from __future__ import annotations

import sys

import torch

__all__ = ["full_value", "local_shard", "shard_like", "like_param"]


def _dtensor() -> type | None:
    """The ``DTensor`` class if its module is imported, else None (then nothing is one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s full value (an all-gather / all-reduce: a collective of its mesh); a
    tensor as it is."""
    dtensor = _dtensor()
    return t.full_tensor() if dtensor is not None and isinstance(t, dtensor) else t


def local_shard(t):
    """A ``DTensor``'s local shard (no copy, no communication); anything else as it is."""
    dtensor = _dtensor()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (the whole tensor, on every rank) cut as ``like`` is, from this rank's copy (no
    communication): a ``DTensor`` of ``like``'s mesh, placements and dtype, or, ``like`` a plain
    tensor, ``full`` on its device."""
    dtensor = _dtensor()
    if dtensor is None or not isinstance(like, dtensor):
        return full.to(like.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements,
                             src_data_rank=None)


def like_param(value, param: torch.Tensor):
    """A saved optimizer-state entry (a local shard, as :func:`local_shard` gave it) as a
    ``DTensor`` laid out as ``param``; a scalar (``step``), an entry of another shape, or any
    entry of a plain ``param``, as it is."""
    dtensor = _dtensor()
    if not (dtensor is not None and isinstance(param, dtensor) and isinstance(value, torch.Tensor)
            and value.shape == param.to_local().shape and value.dim() > 0):
        return value
    return dtensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride(), run_check=False)
