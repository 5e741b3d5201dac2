"""Context-parallel (CP) shards of a packed microbatch: which positions each CP rank holds.

CP of size ``c`` uses the load-balanced split of Megatron-LM / TransformerEngine
(``get_batch_on_this_cp_rank``, ``thd_get_partitioned_indices``): every segment of the
:class:`replayrl.trainer.batching.packing.PackedLayout` is padded to a multiple of ``2c``
(``PackedLayout.from_lengths(..., cp_size=c)``) and cut into ``2c`` equal chunks; rank ``r``
holds chunks ``r`` and ``2c - 1 - r`` of every segment, segment after segment, so causal
attention work is balanced across ranks.

Arrays may be numpy arrays or torch tensors (any trailing shape); torch outputs stay on the
input device and keep autograd (shards of logprobs are differentiable).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from replayrl.trainer.batching.packing import PackedLayout
from replayrl.trainer.errors import PackedFieldError, PackingError

__all__ = ["cp_shard_indices", "cp_shard", "cp_unshard"]


def cp_shard_indices(layout: PackedLayout, rank: int, cp_size: int) -> np.ndarray:
    """Packed positions of ``layout`` held by CP rank ``rank`` of ``cp_size``, in shard order.

    For every segment (in order), chunks ``rank`` and ``2 * cp_size - 1 - rank`` of its
    ``2 * cp_size`` equal chunks (Megatron-LM / TransformerEngine load-balanced CP).
    ``cp_size == 1`` holds everything.

    Returns:
        read-only int64 array ``[T / cp_size]``.

    Raises:
        PackingError: a bad rank / size. PackedFieldError: a segment whose padded length is not
            a multiple of ``2 * cp_size`` (names the sample; build the layout with
            ``from_lengths(..., cp_size=...)``).
    """
    if isinstance(cp_size, (bool, np.bool_)) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise PackingError(f"cp_size must be a positive int, got {cp_size!r}")
    cp = int(cp_size)
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < cp:
        raise PackingError(f"CP rank must be an int in [0, {cp}), got {rank!r}")
    if cp == 1:
        idx = np.arange(layout.total_length, dtype=np.int64)
    else:
        parts = []
        for i, n in enumerate(layout.padded_lengths):
            if n % (2 * cp):
                raise PackedFieldError(
                    layout.sample_name(i), "padded length",
                    f"{n} is not a multiple of 2 * cp_size = {2 * cp}; build the layout with "
                    f"PackedLayout.from_lengths(..., cp_size={cp})")
            chunk, start = n // (2 * cp), int(layout.cu_seqlens_padded[i])
            for c in (rank, 2 * cp - 1 - rank):
                parts.append(start + c * chunk + np.arange(chunk, dtype=np.int64))
        idx = np.concatenate(parts)
    idx.flags.writeable = False
    return idx


def cp_shard(layout: PackedLayout, packed: Any, rank: int, cp_size: int, *,
             field: str = "packed") -> Any:
    """The rows of a packed ``[T, *trailing]`` array that CP rank ``rank`` holds.

    Args:
        layout: the microbatch's layout; packed: numpy array or torch tensor ``[T, ...]``.
        rank, cp_size: ``0 <= rank < cp_size``; field: name for error messages.

    Returns:
        same type as ``packed``, ``[T / cp_size, *trailing]`` (a copy; torch: differentiable).

    Raises:
        PackingError: as :func:`cp_shard_indices`, or a wrong row count.
    """
    layout.check_packed(packed, field)
    idx = cp_shard_indices(layout, rank, cp_size)
    if isinstance(packed, torch.Tensor):
        return packed.index_select(0, torch.tensor(idx, device=packed.device))
    return packed[idx]


def cp_unshard(layout: PackedLayout, shards: Sequence[Any], *, field: str = "packed") -> Any:
    """Reassemble the packed ``[T, *trailing]`` array from the shards of ranks ``0..c-1``.

    ``shards[r]`` is rank ``r``'s :func:`cp_shard` (e.g. after an all-gather); ``c`` is
    ``len(shards)``. All numpy or all torch (torch: differentiable, on the first shard's device).

    Raises:
        PackingError: no shards, a shard of the wrong row count, a numpy / torch mix, or as
            :func:`cp_shard_indices`.
    """
    shards = list(shards)
    cp = len(shards)
    if cp == 0:
        raise PackingError(f"{field}: no shards to unshard")
    order = np.concatenate([cp_shard_indices(layout, r, cp) for r in range(cp)])
    for r, s in enumerate(shards):
        if not isinstance(s, (torch.Tensor, np.ndarray)) or s.ndim < 1 \
                or s.shape[0] != layout.total_length // cp:
            raise PackingError(f"{field}: shard of CP rank {r} must have "
                               f"{layout.total_length // cp} rows, got "
                               f"{getattr(s, 'shape', type(s).__name__)}")
    inverse = np.argsort(order, kind="stable")
    if all(isinstance(s, torch.Tensor) for s in shards):
        return torch.cat(shards).index_select(0, torch.from_numpy(inverse).to(shards[0].device))
    if any(isinstance(s, torch.Tensor) for s in shards):
        raise PackingError(f"{field}: mix of torch tensors and numpy arrays")
    return np.concatenate(shards)[inverse]
