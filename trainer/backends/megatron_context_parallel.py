"""Context parallelism (CP) in the megatron-core backend: the row layout, the attention, the gathers.

With ``--cp-size c > 1`` every right-padded row of a microbatch is cut into ``2c`` equal chunks
and CP rank ``r`` holds chunks ``r`` and ``2c - 1 - r`` (the load-balanced causal layout of
Megatron-LM's ``get_batch_on_this_cp_rank``): :func:`row_layout` describes the row as one
:class:`replayrl.trainer.batching.packing.PackedLayout` segment and
:func:`replayrl.trainer.parallel.context_parallel.cp_shard_indices`
gives a rank's positions. megatron-core's ``RotaryEmbedding`` slices the rotary table per CP
rank itself (``get_pos_emb_on_this_cp_rank``, the same two chunks), so each rank's tokens get
their global RoPE positions (docs/design/megatron.md#context-parallel).

megatron-core 0.16.1's local ``DotProductAttention`` refuses ``context_parallel_size > 1``
(context parallelism is TransformerEngine-only there), so :func:`context_parallel_attention_class`
places a CP-capable core attention in the layer spec: it all-gathers keys and values over the CP
group with megatron's ``gather_from_sequence_parallel_region`` (all-gather forward,
reduce-scatter backward, so every key's gradient reaches the rank that owns it), puts them back
in global order, and masks causally on the true global positions of the rank's query chunks
(or takes the query rows of a full-sequence mask, the indexer's). Everything after the gather is
megatron's own attention arithmetic. This is the all-gather form of CP (as Llama 3's), not TE's
ring exchange: each rank holds all keys of a layer at once, ``O(S)`` memory per rank instead of
``O(S / c)``, which is what a CPU-testable layout affords.

Gradient scaling: every CP rank computes the same loss from the gathered logprobs; the
gather's reduce-scatter backward sums the ``c`` copies of each shard's gradient and megatron's
DDP divides by the data-parallel x context-parallel size, so the update is the one-rank one.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist

from replayrl.trainer.batching.packing import PackedLayout
from replayrl.trainer.errors import PackingError
from replayrl.trainer.parallel.context_parallel import cp_shard_indices, cp_unshard

__all__ = ["ContextParallel", "row_layout", "context_parallel_attention_class"]


@functools.lru_cache(maxsize=64)
def row_layout(width: int, cp_size: int, tp_size: int) -> PackedLayout:
    """One right-padded row of at least ``width`` positions as a one-segment layout.

    The segment is padded to a multiple of ``2 * cp_size`` (the CP chunks) and of
    ``cp_size * tp_size`` (sequence parallelism splits each CP rank's positions evenly over the
    TP ranks); with ``cp_size == 1`` to a multiple of ``tp_size``.

    Raises:
        replayrl.trainer.batching.packing.PackingError: a non-positive size.
    """
    return PackedLayout.from_lengths([max(int(width), 1)], pad_to_multiple_of=cp_size * tp_size,
                                     cp_size=cp_size)


class ContextParallel:
    """This rank's place in the CP group and the shard / gather operations of one row width.

    Args:
        rank, size: this rank's CP rank and the CP size (``size > 1``).
        group: the CP process group (megatron's ``get_context_parallel_group()``).
        tp_size: tensor-parallel size (for :func:`row_layout`).
    """

    def __init__(self, rank: int, size: int, group, tp_size: int) -> None:
        self.rank, self.size, self.group, self.tp_size = int(rank), int(size), group, int(tp_size)
        self._positions: dict[int, torch.Tensor] = {}  # width -> positions (read by every layer)

    @classmethod
    def from_megatron(cls) -> "ContextParallel":
        """From megatron's parallel state (call after ``initialize_model_parallel``)."""
        from megatron.core import parallel_state as ps

        return cls(ps.get_context_parallel_rank(), ps.get_context_parallel_world_size(),
                   ps.get_context_parallel_group(), ps.get_tensor_model_parallel_world_size())

    def width(self, positions: int) -> int:
        """Padded row width ``W`` for rows of ``positions`` positions (see :func:`row_layout`)."""
        return row_layout(positions, self.size, self.tp_size).total_length

    def positions(self, width: int) -> torch.Tensor:
        """Global positions this rank holds of a row of ``width``: int64 ``[width / size]``,
        chunk ``rank`` then chunk ``2 * size - 1 - rank``.

        Raises:
            replayrl.trainer.batching.packing.PackingError: ``width`` is not a padded row width (:meth:`width`).
        """
        if width not in self._positions:
            layout = row_layout(width, self.size, self.tp_size)
            if layout.total_length != width:
                raise PackingError(f"a CP row of {width} positions does not split into "
                                   f"{2 * self.size} chunks over {self.tp_size} SP ranks; pad it "
                                   f"to {layout.total_length} (ContextParallel.width)")
            self._positions[width] = torch.from_numpy(np.array(cp_shard_indices(layout, self.rank, self.size)))
        return self._positions[width]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of ``x`` along ``dim`` (of size ``W``), in shard order."""
        return x.index_select(dim, self.positions(x.shape[dim]))

    def gather(self, local: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """All ranks' shards of a row quantity, in global order along ``dim``.

        ``local`` is this rank's ``[..., W / size, ...]`` (shard order along ``dim``); the
        result ``[..., W, ...]`` is differentiable: megatron's
        ``gather_from_sequence_parallel_region`` over the CP group (backward: reduce-scatter,
        summing every rank's gradient of this rank's shard).
        """
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        x = local.movedim(dim, 0).contiguous()
        if torch.is_grad_enabled() and x.requires_grad:
            full = gather_from_sequence_parallel_region(x, group=self.group)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
            full = torch.cat(parts)
        return self.unshard(full.chunk(self.size)).movedim(0, dim)

    def unshard(self, parts) -> torch.Tensor:
        """The ranks' shards ``parts[r]`` (``[W / size, ...]`` each, shard order, rank ``r``'s
        positions) as one ``[W, ...]`` in global order (differentiable; what :meth:`gather`
        does after its all-gather).

        Raises:
            replayrl.trainer.batching.packing.PackingError: not ``size`` shards of ``W / size`` rows.
        """
        width = sum(p.shape[0] for p in parts)
        return cp_unshard(row_layout(width, self.size, self.tp_size), parts, field="CP-gathered rows")

    def causal_mask(self, width: int) -> torch.Tensor:
        """bool ``[1, 1, W / size, W]``, True = masked out: the keys after each local query's
        global position."""
        q = self.positions(width)
        return (torch.arange(width)[None, :] > q[:, None])[None, None]

    def query_mask(self, width: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The mask of this rank's queries against all ``W`` keys in global order: the causal
        mask on the queries' global positions, and, with a full-sequence ``attention_mask``
        (bool ``[B, 1, W, W]``, True = masked out: the indexer's choices, whose key slots are
        global positions), its rows of this rank's positions (chunk ``rank`` then chunk
        ``2 * size - 1 - rank``): the choices rebased to the rank's query order, keys as they are.

        Returns:
            bool ``[1 or B, 1, W / size, W]``.

        Raises:
            ValueError: ``attention_mask`` is not ``[B, 1, W, W]``.
        """
        masked = self.causal_mask(width)
        if attention_mask is None:
            return masked
        if attention_mask.ndim != 4 or attention_mask.shape[1] != 1 \
                or attention_mask.shape[-2:] != (width, width):
            raise ValueError(f"ContextParallelAttention takes a full-sequence mask "
                             f"[B, 1, {width}, {width}], got {tuple(attention_mask.shape)}")
        return masked | attention_mask.index_select(2, self.positions(width))

    def logprobs(self, logits: torch.Tensor, row: torch.Tensor, pos: torch.Tensor, fn) -> torch.Tensor:
        """Per-token logprobs computed on this rank's shard, gathered back to the batch order.

        Args:
            logits: ``[B, W / size, V_local]``, this rank's positions in shard order.
            row, pos: int64 ``[N]``, the batch's token rows and global positions.
            fn: ``fn(rows, select) -> [n]``: logprobs of the logits ``rows [n, V_local]`` of the
                tokens ``select`` (int64 indices into ``0 .. N``); a collective over TP only,
                so every CP rank may hold a different ``n``.

        Returns:
            float32 ``[N]`` in the batch's order, differentiable (see :meth:`gather`).
        """
        b, s_local = logits.shape[:2]
        width = s_local * self.size
        slot = torch.full((width,), -1, dtype=torch.long)
        slot[self.positions(width)] = torch.arange(s_local)
        local = slot[pos]
        select = (local >= 0).nonzero()[:, 0]
        part = fn(logits[row[select], local[select]], select)
        dense = part.new_zeros(s_local, b).index_put((local[select], row[select]), part)
        return self.gather(dense, 0)[pos, row]


def context_parallel_attention_class(base=None):
    """megatron ``DotProductAttention`` subclass that runs under context parallelism.

    The subclass is built with a config copy whose ``context_parallel_size`` is 1 (megatron's
    local attention asserts it; the arithmetic is per query block either way) and, in
    ``forward``, gathers keys and values over the CP group (:meth:`ContextParallel.gather`)
    before megatron's attention. ``attention_mask``: None (causal on global positions) or a
    full-sequence bool mask ``[B, 1, W, W]`` (True = masked out, e.g. the indexer's), of which
    the local query rows are taken; the causal mask is applied in both cases.

    Args:
        base: the core attention class to run after the gather: megatron's
            ``DotProductAttention`` (None) or a subclass of it, e.g. the multi-latent
            attention's (:func:`replayrl.trainer.backends.megatron_mla.latent_attention_class`):
            MLA's keys and values are per-head tensors after its up projections, gathered like
            any other (the latent is not what travels; docs/design/megatron.md#megatron-families).
    """
    import copy

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    base = base or DotProductAttention
    if not issubclass(base, DotProductAttention):
        raise TypeError(f"context_parallel_attention_class: {base.__name__} is not a megatron "
                        f"DotProductAttention")

    class ContextParallelAttention(base):
        """Core attention of a CP rank's query chunks against every key (global order)."""

        def __init__(self, config, *args, **kwargs):
            local = copy.copy(config)
            local.context_parallel_size = 1
            super().__init__(local, *args, **kwargs)
            self.cp = ContextParallel.from_megatron()

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            """query ``[S_local, B, heads, hn]``, key / value ``[S_local, B, groups, hn]`` of
            this rank's positions; returns ``[S_local, B, heads * hn]``."""
            if packed_seq_params is not None:
                raise ValueError("ContextParallelAttention takes right-padded rows, not packed ones")
            width = query.shape[0] * self.cp.size
            key, value = self.cp.gather(key, 0), self.cp.gather(value, 0)
            masked = self.cp.query_mask(width, attention_mask)
            return super().forward(query, key, value, masked, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)

    return ContextParallelAttention

