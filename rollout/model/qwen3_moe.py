"""The embedded default model: a Qwen3-MoE decoder in plain torch, with trace capture and replay.

Math and parameter names follow Hugging Face transformers' `Qwen3MoeForCausalLM` (checked by
tests/unit/rollout/test_model_hf_parity.py): RMSNorm (normalise in float32, cast back, then scale), default
RoPE with rotate-half, grouped-query attention with RMSNorm over head_dim on q and k before RoPE,
softmax top-k MoE routing (softmax in float32 over the router logits, top-k, renormalise if
norm_topk_prob, cast back) over SiLU-gated experts, dense SiLU-gated MLPs on the non-MoE layers,
final norm and an lm_head, tied to the embedding or not. With no experts every layer is dense:
the model is HF's dense `Qwen3ForCausalLM`, with the same parameter names. RoPE may be scaled
(linear, YaRN, Llama-3; rollout/model/rope.py). Layers listed in `config.indexed_layers`
restrict attention to the keys chosen by a DSA-style indexer (rollout/model/indexer.py).

Traces (docs/design/traces.md#trace-arrays): with `capture=True` the forward returns the experts every
MoE router used (R3, Ma et al. 2025 "Stabilizing MoE RL by aligning training and inference
routers"; as in slime / Megatron) and the key slots every indexer kept; passing them back as
`routed_experts` / `indexer_topk` replays those discrete choices while the routing weights stay
differentiable functions of the router logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.errors import ModelInputError
from replayrl.rollout.model.indexer import Indexer, gathered_attention, resolve_replay, select_topk, slots_to_mask
from replayrl.rollout.model.kv_cache import KVCache, append_along
from replayrl.rollout.model.rope import rope_frequencies
from replayrl.rollout.model.shared_prefix import can_share, shared_prefix_attention


@dataclass(frozen=True)
class CausalLMOutput:
    """Result of `Qwen3MoeForCausalLM.forward`.

    logits: `[B, S, vocab_size]` in the model dtype (bf16 for the engine, fp32 for the trainer),
        or None when the forward was asked not to compute them.
    hidden: `[B, S, hidden_size]` after the final norm (model dtype) if `return_hidden`, else None.
    routed_experts: int32 `[B, S, L_moe, K]` experts used per token and MoE layer (in
        `config.moe_layers` order) if `capture` and the model has MoE layers, else None.
    indexer_topk: int32 `[B, S, L_idx, index_topk]` key slots (indices into this row's
        cache + current key sequence) used per query and indexed layer, -1 = no key, if
        `capture` and the indexer is on, else None.
    own_routed_experts, own_indexer_topk: same shapes, what the router / indexer of THIS forward
        would have chosen; they differ from the used ones only under replay, and the fraction of
        rows where they differ is the routing / indexer flip rate of the replay.
    """

    logits: torch.Tensor | None
    hidden: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    indexer_topk: torch.Tensor | None = None
    own_routed_experts: torch.Tensor | None = None
    own_indexer_topk: torch.Tensor | None = None


class Qwen3MoeRMSNorm(nn.Module):
    """RMSNorm over the last axis (Zhang & Sennrich 2019), HF order: normalise in fp32, cast, scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., dim]` -> same shape and dtype."""
        # F.rms_norm is one kernel for what HF writes as five ops; bit-identical in float32
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, config: ModelConfig,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables (Su et al. 2021, RoFormer; scaled as `config.rope_scaling` says, see
    rollout/model/rope.py), each `[B, 1, S, head_dim]` in `dtype`.

    Angles are computed in float32 from the integer positions, as HF does; the frequencies are
    recomputed per call so that `model.to(bf16)` cannot round them. A scaling with an attention
    factor (YaRN) multiplies cos and sin by it, as HF does.
    """
    inv_freq, attention_scaling = rope_frequencies(config.rope_theta, config.head_dim,
                                                   config.rope_scaling)
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[B, heads, S, head_dim]` by the RoPE tables (rotate-half convention)."""
    return x * cos + _rotate_half(x) * sin


# An indexed layer attends over gathered keys (rollout/model/indexer.py gathered_attention) once
# a row has at least this many key slots per kept key; below, the masked dense kernel is cheaper
# (fewer ops). The engine's decode step gathers too: its one-token queries read index_topk keys
# per row instead of the whole cache (attention there is bound by reading the cache).
GATHER_MIN_KEYS_PER_PICK = 4


# Packed rows (segment_ids: a prefix tree or packed samples) of at least this many slots are
# forwarded per block of queries over only the key slots the block may see (`_key_blocks`).
BLOCK_MIN_SLOTS = 128


def _key_blocks(segment_ids: torch.Tensor, dense: torch.Tensor) -> tuple | None:
    """Query blocks of packed rows and the key slots each block may see, or None (not worth it).

    segment_ids int `[B, S]`, dense bool `[B, S, S]` (every key a query may attend to). Blocks
    end where a segment ends in any row, merged up to `BLOCK_MIN_SLOTS // 2` queries each; a
    block's key slots are those some query of it sees (sorted ascending), so attention and the
    indexer's scores over them are those over all T slots with the never-seen ones left out.
    None when the blocks would still cover more than half of the `[S, T]` pairs.
    """
    s = segment_ids.shape[1]
    if s < BLOCK_MIN_SLOTS:
        return None
    ends = ((segment_ids[:, 1:] != segment_ids[:, :-1]).any(0).nonzero().flatten() + 1).tolist() + [s]
    blocks, start, seen = [], 0, dense.any(0)
    for end in ends:
        if end - start < BLOCK_MIN_SLOTS // 2 and end < s:
            continue
        blocks.append((start, end, seen[start:end].any(0).nonzero().flatten()))
        start = end
    if sum((e - b) * len(cols) for b, e, cols in blocks) * 2 > s * s:
        return None
    return tuple(blocks)


@dataclass(frozen=True)
class _Masks:
    """Attention masks of one forward, bool `[B, S, T]` with T = S_past + S key slots."""

    allowed: torch.Tensor      # causal (by slot) and the key is not padding
    dense: torch.Tensor        # allowed, plus each query's own slot so padding rows stay finite
    candidates: torch.Tensor   # indexer candidates: allowed and the query itself is not padding
    own_slot: torch.Tensor     # each query's own slot
    own_slot_index: torch.Tensor  # int64 [S]: the slot of each query, S_past + i
    blocks: tuple | None = None  # ((start, end, key slots int64 [T_j]), ...) or None, `_key_blocks`
    cached: bool = False  # a KV cache is filled: indexed layers keep their indexer keys
    own_indexer: bool = True  # indexed layers compute their own top-k even where a replay covers it
    # bool [B, S]: queries with a candidate key (only without own_indexer: `_unreplayed_queries`)
    picking_query: torch.Tensor | None = None


def _unreplayed_queries(replay: torch.Tensor, masks: _Masks) -> bool:
    """Whether a query that has keys to pick from has an all -1 replay row (int `[B, S, k]`):
    the layer's own top-k is needed there (`resolve_replay`)."""
    return bool(((replay < 0).all(-1) & masks.picking_query).any())


class Qwen3MoeAttention(nn.Module):
    """GQA self-attention with q/k RMSNorm, RoPE and an optional indexer."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = Qwen3MoeRMSNorm(d, config.rms_norm_eps)
        self.k_norm = Qwen3MoeRMSNorm(d, config.rms_norm_eps)
        self.indexer = (Indexer(h, config.index_n_heads, config.index_head_dim, config.index_topk)
                        if layer_idx in config.indexed_layers else None)

    def forward(self, x, cos, sin, masks: _Masks, past, index_replay):
        """x `[B, S, hidden]` -> (output `[B, S, hidden]`, (keys, values, indexer keys) over all
        T slots for the cache (after the cache's shared prefix, if it has one), key slots used
        int64 `[B, S, index_topk]` or None, the indexer's own choice of slots (same shape) or
        None)."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # the layer's own top-k (and so its indexer keys) is skipped where a replay covers every
        # real query and nothing asked for it (own_indexer False); a KV cache always keeps the keys
        own_needed = self.indexer is not None and (
            masks.own_indexer or index_replay is None or _unreplayed_queries(index_replay, masks))
        ik = self.indexer.keys(x) if own_needed or (self.indexer is not None and masks.cached) else None
        shared = past[3] if past is not None else None  # a dense layer's prompt, once per block
        if past is not None:
            k, v = append_along(past[0], k, 2), append_along(past[1], v, 2)
            if ik is not None:
                ik = append_along(past[2], ik, 1)

        slots = own = None
        mask = masks.dense
        if self.indexer is not None:
            mask = None
            if own_needed:
                with torch.no_grad():
                    own = self._own_picks(x, ik, masks)
            slots = resolve_replay(own, index_replay, masks.allowed, self.layer_idx)
            own = own if masks.own_indexer else None
            if k.shape[2] < GATHER_MIN_KEYS_PER_PICK * self.indexer.topk:
                mask = slots_to_mask(slots, k.shape[2])
                # A query without any key (a padding query) attends to itself only: finite, unused.
                mask = mask | (masks.own_slot & ~mask.any(-1, keepdim=True))

        if self.indexer is not None and mask is None:
            # long rows: only the index_topk kept keys of each query, gathered (O(S k), not O(S T))
            out = gathered_attention(q, k, v, slots, masks.own_slot_index, self.head_dim ** -0.5)
        elif shared is not None and can_share(q):
            # decode over a prompt group: the prompt's keys read once per group (shared_prefix.py)
            out = shared_prefix_attention(q, shared, k, v, mask[:, :, shared.length:], self.head_dim ** -0.5)
        elif shared is not None:
            prefix_keys, prefix_values = shared.expanded()
            out = self._attend(q, torch.cat([prefix_keys, k], 2), torch.cat([prefix_values, v], 2), mask)
        elif masks.blocks is not None:
            # packed rows: each query block over the key slots it may see only
            out = torch.cat([self._attend(q[:, :, i0:i1], k.index_select(2, cols), v.index_select(2, cols),
                                          mask[:, i0:i1][:, :, cols]) for i0, i1, cols in masks.blocks], dim=2)
        else:
            out = self._attend(q, k, v, mask)
        out = out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        return self.o_proj(out), (k, v, ik), slots, own

    def _attend(self, q, k, v, mask):
        """Masked attention: q `[B, H, S, D]`, k / v `[B, H_kv, T, D]`, mask bool `[B, S, T]`."""
        # enable_gqa: each KV head serves n_heads / n_kv_heads query heads without the
        # repeat_interleave copies of k and v HF makes (same values)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None],
                                              scale=self.head_dim ** -0.5, enable_gqa=True)

    def _own_picks(self, x, ik, masks: _Masks) -> torch.Tensor:
        """The indexer's top-k key slots int64 `[B, S, index_topk]` (`select_topk`), on packed
        rows scored per query block against the key slots the block may see only (a block's
        slots ascend, so the tie rule, the later slot first, is unchanged)."""
        if masks.blocks is None:
            return select_topk(self.indexer.scores(x, ik), masks.candidates, self.indexer.topk)
        picks = []
        for i0, i1, cols in masks.blocks:
            local = select_topk(self.indexer.scores(x[:, i0:i1], ik.index_select(1, cols)),
                                masks.candidates[:, i0:i1][:, :, cols], self.indexer.topk)
            picks.append(torch.where(local >= 0, cols[local.clamp_min(0)], local))
        return torch.cat(picks, dim=1)


class Qwen3MoeMLP(nn.Module):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x)); a dense layer or one expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[..., hidden]` -> `[..., hidden]`."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the dtype whose CPU grouped_mm runs oneDNN kernels compiled per distinct group size and kept
# in its primitive caches (up to 1024 entries each): a decode loop, whose expert group sizes
# change every token, grew a bf16 engine by 100+ MiB. Its groups are padded to a few sizes
# instead. (fp16 was left out: padding changed its outputs in the last bits, a review found.)
_PADDED_GROUP_DTYPES = (torch.bfloat16,)


def _grouped_mm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows `[N, in]` grouped by expert, weights `[E, in, out]`, ends int32 `[E]` (cumulative
    row counts) -> `[N, out]`: row block e times weights[e]. torch's grouped_mm has no float64
    kernel (the fp64 reference tests run one matmul per expert instead)."""
    if rows.dtype in _GROUPED_MM_DTYPES:
        return F.grouped_mm(rows, weights, offs=ends)
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return torch.cat([r @ w for r, w in zip(rows.split(counts), weights)])


def padded_group_sizes(counts: torch.Tensor) -> torch.Tensor:
    """Each expert's row count `counts` (int64 `[E]`) rounded up to the next of a few sizes:
    a multiple of 8 up to 64, then of 32 up to 256, then of 128 (int64 `[E]`, 0 stays 0).

    Bounds the distinct group sizes a decode loop feeds oneDNN (each compiled and cached once)
    while padding a group by at most 7 rows below 64 and by < 1/2 of it above."""
    step = torch.where(counts <= 64, 8, torch.where(counts <= 256, 32, 128))
    return (counts + step - 1) // step * step


def _expert_slots(pairs: torch.Tensor, num_experts: int, pad: bool) -> tuple[torch.Tensor, ...]:
    """Where each (token, slot) pair goes in the experts' grouped rows.

    pairs int64 `[N*K]` (each pair's expert) -> (source pair of each grouped row int64 `[R]`,
    -1 for a padding row; grouped row of each pair int64 `[N*K]`; ends int32 `[E]`). Within an
    expert the pairs keep their (token, slot) order (a stable sort); with `pad` each expert's
    group is followed by padding rows up to :func:`padded_group_sizes`, else R = N*K.
    Example: pairs [1, 0, 1] with pad=False -> source [1, 0, 2], position [1, 0, 2], ends [1, 3]."""
    order = torch.argsort(pairs, stable=True)
    counts = torch.bincount(pairs, minlength=num_experts)
    if not pad:
        position = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=pairs.device))
        return order, position, counts.cumsum(0).to(torch.int32)
    sizes = padded_group_sizes(counts)
    ends = sizes.cumsum(0)
    # the j-th pair in expert order sits at its expert's padded start + its rank in the expert
    shift = torch.repeat_interleave(ends - sizes - (counts.cumsum(0) - counts), counts)
    grouped = torch.arange(len(order), device=pairs.device) + shift
    source = torch.full((int(ends[-1]),), -1, dtype=torch.int64, device=pairs.device)
    source[grouped] = order
    position = torch.empty_like(order).scatter_(0, order, grouped)
    return source, position, ends.to(torch.int32)


def _stack_experts(weights: list[list[torch.Tensor]]) -> torch.Tensor:
    """Per expert, its projections' weights `[out_p, in]` concatenated along out, stacked:
    `[E, sum out_p, in]` (a new tensor)."""
    return torch.stack([torch.cat(ws) if len(ws) > 1 else ws[0] for ws in weights])


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Softmax top-k router (`gate.weight` `[E, hidden]`) over SiLU-gated experts."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Qwen3MoeMLP(config.hidden_size, config.moe_intermediate_size)
            for _ in range(config.num_experts))
        self.stack_cache: dict | None = None  # None: stacks built by every forward

    def _stacked(self, *projections: str) -> torch.Tensor:
        """The experts' `projections` weights as one `[E, in, out]` tensor (a transposed view of
        `[E, out, in]`, projections concatenated along out), differentiable into each expert's
        nn.Linear, which keeps HF's per-expert parameter names.

        Built anew by every forward unless :meth:`Qwen3MoeForCausalLM.reuse_expert_stacks` turned
        reuse on (the engine's model only): then a forward without gradients returns the stack
        the expert weights are views of, while every weight still is (same data pointers), or
        else the stack of an earlier forward while every weight is the same tensor at the same
        version counter. Not for a trained model: fused AdamW updates parameters in place
        without bumping their version counters (tests/unit/rollout/test_model_expert_stack.py)."""
        weights = [[getattr(e, p).weight for p in projections] for e in self.experts]
        reuse = self.stack_cache is not None and not torch.is_grad_enabled()
        if reuse:
            pointers = tuple(w.data_ptr() for ws in weights for w in ws)
            hit = self.stack_cache.get(projections)
            if hit is not None and hit[0] == pointers and (
                    hit[1] is None or hit[1] == tuple(w._version for ws in weights for w in ws)):
                return hit[2]
        out = _stack_experts(weights).transpose(-2, -1)
        if reuse:
            self.stack_cache[projections] = (pointers, tuple(w._version for ws in weights for w in ws), out)
        return out

    def fuse_expert_weights(self) -> None:
        """Make every expert's weights views into the two stacks the grouped matmuls read
        (`[E, 2 * moe_intermediate, hidden]` gate/up and `[E, hidden, moe_intermediate]` down,
        values kept), so the block holds one copy of its experts instead of the weights plus
        their stacks, and in-place writes (a weight push, a LoRA merge) land in the stacks.
        Requires :meth:`Qwen3MoeForCausalLM.reuse_expert_stacks` (``stack_cache`` on); a weight
        later replaced by another tensor is stacked anew, as without fusion."""
        for projections in (("gate_proj", "up_proj"), ("down_proj",)):
            weights = [[getattr(e, p).weight for p in projections] for e in self.experts]
            with torch.no_grad():
                fused = _stack_experts(weights)
            for expert, olds, ws in zip(self.experts, weights, fused):
                start = 0
                for p, old in zip(projections, olds):
                    rows = old.shape[0]
                    getattr(expert, p).weight = nn.Parameter(ws[start:start + rows],
                                                             requires_grad=old.requires_grad)
                    start += rows
            pointers = tuple(getattr(e, p).weight.data_ptr() for e in self.experts for p in projections)
            # None for the versions: the weights are the stack's own memory, so an in-place
            # write changes the stack too and never makes it stale
            self.stack_cache[projections] = (pointers, None, fused.transpose(-2, -1))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None):
        """x `[B, S, hidden]`, replay int `[B, S, K]` or None -> (output, experts used int64
        `[B, S, K]`, the router's own top-k int64 `[B, S, K]`).

        Under replay the weights are the router's softmax probabilities of the replayed experts
        (renormalised if norm_topk_prob), so the router still gets gradients (R3). A replay row
        of only -1 keeps the router's own choice.
        """
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        logits = self.gate(flat)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        own = experts
        if replay is not None:
            replay = replay.reshape(-1, self.top_k).long()
            experts = torch.where((replay < 0).all(-1, keepdim=True), experts, replay)
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(logits.dtype)

        # The (token, slot) pairs are grouped by expert with one stable sort (within an expert
        # in (token, slot) order, the rows each expert saw before) and gathered once; the
        # experts' weights, stacked for this forward, run every group in one grouped matmul per
        # projection (torch's grouped_mm: one kernel instead of three per expert); the rows go
        # back to (token, slot) order with one index and the K slots are summed (no index_add_
        # in the forward: its bf16 CPU kernel was ~100x slower than its fp32 one). HF sums the
        # same K terms in expert order instead of slot order; in fp32 the difference is
        # rounding (~1e-7). In bf16 the groups are padded (see _PADDED_GROUP_DTYPES): the real
        # rows' products are the same up to the kernel oneDNN picks for the padded size (bit
        # for bit with AMX here; tests/unit/rollout/test_model_expert_groups.py).
        pad = flat.dtype in _PADDED_GROUP_DTYPES
        source, position, ends = _expert_slots(experts.reshape(-1), len(self.experts), pad)
        # a padding row (source -1) repeats token 0: finite, and its output is never read
        # index_select, not [] indexing: the same rows, and its backward (index_add_) is faster
        # on CPU than the accumulating index_put_ of [] (with top-k > 2 it sums a token's K
        # gradient rows in another order: float rounding)
        rows = flat.index_select(0, source.clamp_min(0) // self.top_k)
        gate_up = _grouped_mm(rows, self._stacked("gate_proj", "up_proj"), ends)
        gate, up = gate_up.chunk(2, dim=-1)
        out = _grouped_mm(F.silu(gate) * up, self._stacked("down_proj"), ends)
        per_slot = out.index_select(0, position) * weights.reshape(-1, 1)
        return (per_slot.view(-1, self.top_k, h).sum(1).view(b, s, h),
                experts.view(b, s, self.top_k), own.view(b, s, self.top_k))


class Qwen3MoeDecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)), the MLP dense or MoE."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_moe = layer_idx in config.moe_layers
        self.input_layernorm = Qwen3MoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3MoeAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3MoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (Qwen3MoeSparseMoeBlock(config, layer_idx) if self.is_moe
                    else Qwen3MoeMLP(config.hidden_size, config.intermediate_size))

    def forward(self, h, cos, sin, masks, past, index_replay, expert_replay):
        """h `[B, S, hidden]` -> (h, cache entry, (key slots used, own key slots) or Nones,
        (experts used, own experts) or Nones)."""
        a, kv, slots, own_slots = self.self_attn(self.input_layernorm(h), cos, sin, masks, past,
                                                 index_replay)
        h = h + a
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            m, experts, own_experts = self.mlp(x, expert_replay)
        else:
            m, experts, own_experts = self.mlp(x), None, None
        return h + m, kv, (slots, own_slots), (experts, own_experts)


class Qwen3MoeModel(nn.Module):
    """Embedding, decoder layers and final norm (the `model.` prefix of HF parameter names)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            weight.normal_()  # nn.Embedding's own init, same draw from the global generator
        # Passing the weight skips nn.Embedding.reset_parameters, whose normal_ on the meta
        # device (the loaders build there) imports torch._dynamo: seconds per process.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = Qwen3MoeRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeForCausalLM(nn.Module):
    """Qwen3-MoE causal LM (HF parameter names) with R3 / indexer capture and replay.

    Build with `Qwen3MoeForCausalLM(config)` then `init_weights(seed)` or load weights
    (replayrl.rollout.model.checkpoint). `model.to(torch.bfloat16)` gives the engine's bf16 model; the
    trainer runs fp32.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3MoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @classmethod
    def empty(cls, config: ModelConfig, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> "Qwen3MoeForCausalLM":
        """The model with allocated but uninitialised weights in `dtype` on `device`, for a
        caller that fills every weight (a checkpoint load, a weight push).

        Built on the meta device, then each parameter is allocated once with `torch.empty`: no
        random init, no float32 copy of a bf16 model. (Not `nn.Module.to_empty`: meta
        `empty_like` runs through torch's Python references, which import sympy per process.)
        """
        with torch.device("meta"):
            model = cls(config)
        allocated: dict[int, nn.Parameter] = {}  # a tied parameter is allocated once
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if id(p) not in allocated:
                    allocated[id(p)] = nn.Parameter(
                        torch.empty(p.shape, dtype=dtype, device=device),
                        requires_grad=p.requires_grad)
                setattr(module, name, allocated[id(p)])
        return model

    def tie_weights(self) -> None:
        """With `config.tie_word_embeddings`, make `lm_head.weight` the embedding matrix itself
        (one Parameter, as HF ties them); a no-op otherwise."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the parameters."""
        return self.lm_head.weight.dtype

    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed`: every Linear / Embedding weight ~ N(0, 0.02), norms 1.

        Values are drawn in float32 on the CPU in module order and then cast, so a seed gives the
        same weights on any machine and (rounded) in any dtype. A tied LM head is the embedding
        and draws nothing of its own.
        """
        g = torch.Generator(device="cpu").manual_seed(int(seed))
        with torch.no_grad():
            for module in self.modules():
                if module is self.lm_head and self.config.tie_word_embeddings:
                    continue
                if isinstance(module, Qwen3MoeRMSNorm):
                    module.weight.fill_(1.0)
                elif isinstance(module, (nn.Linear, nn.Embedding)):
                    w = torch.empty(module.weight.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=g)
                    module.weight.copy_(w)

    def reuse_expert_stacks(self, on: bool = True) -> None:
        """Let forwards without gradients read the MoE blocks' experts as stacked weights kept
        across forwards instead of stacking them anew every forward; ``False`` turns it off.

        On: each block's expert weights become views into its stacks
        (:meth:`Qwen3MoeSparseMoeBlock.fuse_expert_weights`: no second copy of the experts, and
        in-place copies into the parameters update the stacks); a weight replaced by another
        tensor is stacked once and reused while it keeps its data pointer and version counter.
        Off: every forward stacks anew (the weights stay views of the old stacks' memory).

        For a model whose weights change only by ordinary in-place copies or by new tensors (the
        engine's: a weight push copies into the parameters, a LoRA push merges with ``copy_``),
        never for one an optimizer steps: fused AdamW writes parameters without bumping their
        version counters, so a stale stack of a replaced weight would be reused.
        """
        for layer in self.model.layers:
            if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
                layer.mlp.stack_cache = {} if on else None
                if on:
                    layer.mlp.fuse_expert_weights()

    def new_kv_cache(self) -> KVCache:
        """An empty `KVCache` for this model's layers."""
        return KVCache(self.config.num_hidden_layers, self.config.indexed_layers)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                key_padding_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None,
                routed_experts: torch.Tensor | None = None,
                indexer_topk: torch.Tensor | None = None,
                capture: bool = False,
                return_hidden: bool = False,
                compute_logits: bool = True,
                segment_ids: torch.Tensor | None = None,
                own_indexer: bool = True) -> CausalLMOutput:
        """Forward S new tokens of B rows, after the S_past tokens in `kv_cache` (if any).

        input_ids: int `[B, S]` in [0, vocab_size). position_ids: int `[B, S]` RoPE positions in
            [0, max_position_embeddings), per row (padding tokens: any valid value, e.g. 0).
        key_padding_mask: bool `[B, S_past + S]`, True = real token; None = all real. Its first
            S_past columns must equal the padding of the cached tokens. Attention is causal by
            slot order and skips padding keys; a padding query may also attend to its own slot,
            so no attention row is empty and padding rows stay finite (but are meaningless).
            Both left padding (engine) and right padding (trainer) work. Padding queries get
            all -1 indexer rows; their routed experts are whatever the router picked.
        kv_cache: from `new_kv_cache()`; the new keys/values are appended in place.
        routed_experts: int `[B, S, L_moe, K]` experts to use instead of the router's top-k
            (R3 replay), values in [0, num_experts); a row of only -1 keeps the router's choice.
        indexer_topk: int `[B, S, L_idx, index_topk]` key slots (into cache + current keys of
            the row) each query of each indexed layer attends to, -1 = none; each slot must be
            causal and not padding; a row of only -1 keeps the indexer's own choice.
        capture: return the experts / key slots actually used (int32) in the output.
        return_hidden: also return the final-norm hidden states.
        segment_ids: int `[B, S]` or None: packed rows hold several samples; a query attends
            only to keys (and indexer candidates) of its own segment, and to the keys of
            segment -1, a shared trunk (a prompt that the segments after it all continue: a
            prefix tree, trainer/batching/prefix_tree.py). Not with a KV cache.
        compute_logits: False skips the LM head (``logits`` is None): a caller that projects
            only candidate tokens from ``hidden`` (fused support replay) never holds [B, S, V].
        own_indexer: False: where ``indexer_topk`` replays every real query's keys, the indexed
            layers skip their own top-k (scores and selection: its only use there is the
            captured ``own_indexer_topk``, which is then None); a query with an all -1 replay
            row still gets it. The trainer's ``--indexer-drift-interval``.

        Experts that no token was routed to get a zero gradient (all experts' weights take
        part in one grouped matmul), so every trainable parameter is in the graph.
        Returns `CausalLMOutput`. Raises `ModelInputError` naming the argument for a wrong shape,
        dtype or value, or a cache of another model / batch / padding.
        """
        cfg = self.config
        b, s, s_past, key_padding_mask = self._check_inputs(
            input_ids, position_ids, key_padding_mask, kv_cache, routed_experts, indexer_topk)
        t = s_past + s
        device = input_ids.device

        q_slot = torch.arange(s_past, t, device=device)
        k_slot = torch.arange(t, device=device)
        causal = k_slot[None, :] <= q_slot[:, None]
        own_slot = (k_slot[None, :] == q_slot[:, None])[None]
        allowed = causal[None] & key_padding_mask[:, None, :]
        if segment_ids is not None:
            if kv_cache is not None or segment_ids.shape != input_ids.shape:
                raise ModelInputError(f"segment_ids must be [B, S] = {tuple(input_ids.shape)} and "
                                      f"used without a KV cache, got {tuple(segment_ids.shape)}")
            allowed = allowed & ((segment_ids[:, :, None] == segment_ids[:, None, :])
                                 | (segment_ids[:, None, :] == -1))
        query_real = key_padding_mask[:, s_past:, None]
        dense = allowed | own_slot
        candidates = allowed & query_real
        own_indexer = own_indexer or indexer_topk is None
        masks = _Masks(allowed=allowed, dense=dense, candidates=candidates,
                       own_slot=own_slot, own_slot_index=q_slot,
                       blocks=_key_blocks(segment_ids, dense) if segment_ids is not None else None,
                       cached=kv_cache is not None, own_indexer=own_indexer,
                       # once per forward, not per indexed layer
                       picking_query=None if own_indexer else candidates.any(-1))

        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, cfg, h.dtype)
        moe_pos = {layer: j for j, layer in enumerate(cfg.moe_layers)}
        idx_pos = {layer: j for j, layer in enumerate(cfg.indexed_layers)}
        keys, values, index_keys = [], [], {}
        experts_used, slots_used, experts_own, slots_own = [], [], [], []
        for i, layer in enumerate(self.model.layers):
            past = kv_cache.past(i) if kv_cache is not None else None
            e_rep = routed_experts[:, :, moe_pos[i]] if routed_experts is not None and i in moe_pos else None
            i_rep = indexer_topk[:, :, idx_pos[i]] if indexer_topk is not None and i in idx_pos else None
            h, (k, v, ik), (slots, own_slots), (experts, own_experts) = layer(
                h, cos, sin, masks, past, i_rep, e_rep)
            keys.append(k)
            values.append(v)
            if ik is not None:
                index_keys[i] = ik
            if experts is not None:
                experts_used.append(experts)
                experts_own.append(own_experts)
            if slots is not None:
                slots_used.append(slots)
                slots_own.append(own_slots)
        h = self.model.norm(h)
        logits = self.lm_head(h) if compute_logits else None
        if kv_cache is not None:
            kv_cache.commit(keys, values, index_keys, key_padding_mask)
        return CausalLMOutput(
            logits=logits,
            hidden=h if return_hidden else None,
            routed_experts=(torch.stack(experts_used, dim=2).to(torch.int32)
                            if capture and experts_used else None),
            indexer_topk=(torch.stack(slots_used, dim=2).to(torch.int32)
                          if capture and slots_used else None),
            own_routed_experts=(torch.stack(experts_own, dim=2).to(torch.int32)
                                if capture and experts_own else None),
            own_indexer_topk=(torch.stack(slots_own, dim=2).to(torch.int32)
                              if capture and slots_own and masks.own_indexer else None),
        )

    def _check_inputs(self, input_ids, position_ids, key_padding_mask, kv_cache,
                      routed_experts, indexer_topk):
        """Validate forward arguments; return (B, S, S_past, key_padding_mask with default)."""
        cfg = self.config
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ModelInputError(f"input_ids must be an integer tensor [B, S], got {_desc(input_ids)}")
        b, s = input_ids.shape
        if b == 0 or s == 0:
            raise ModelInputError(f"input_ids is empty: shape [{b}, {s}]")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size:
            raise ModelInputError(f"input_ids must lie in [0, vocab_size={cfg.vocab_size}), got "
                                  f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        if (not isinstance(position_ids, torch.Tensor) or tuple(position_ids.shape) != (b, s)
                or position_ids.dtype.is_floating_point):
            raise ModelInputError(f"position_ids must be an integer tensor [{b}, {s}], got {_desc(position_ids)}")
        if int(position_ids.min()) < 0 or int(position_ids.max()) >= cfg.max_position_embeddings:
            raise ModelInputError(
                f"position_ids must lie in [0, max_position_embeddings={cfg.max_position_embeddings}), "
                f"got [{int(position_ids.min())}, {int(position_ids.max())}]")
        if kv_cache is not None and not isinstance(kv_cache, KVCache):
            raise ModelInputError(
                f"kv_cache must be a KVCache from model.new_kv_cache(), got {type(kv_cache).__name__}")
        s_past = kv_cache.length if kv_cache is not None else 0
        t = s_past + s
        if key_padding_mask is None:
            key_padding_mask = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
        elif (not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool
              or tuple(key_padding_mask.shape) != (b, t)):
            raise ModelInputError(
                f"key_padding_mask must be a bool tensor [B={b}, S_past+S={t}], got {_desc(key_padding_mask)}")
        if kv_cache is not None:
            kv_cache.check_compatible(cfg.num_hidden_layers, cfg.indexed_layers, b, key_padding_mask)
        if routed_experts is not None:
            if not cfg.moe_layers:
                raise ModelInputError("routed_experts given but the model has no MoE layers")
            k = cfg.num_experts_per_tok
            _check_trace("routed_experts", routed_experts, (b, s, len(cfg.moe_layers), k), cfg.num_experts)
            picked = routed_experts >= 0
            mixed = picked.any(-1) & ~picked.all(-1)
            if bool(mixed.any()):
                raise ModelInputError(f"routed_experts rows must be all -1 or all experts, got "
                                      f"{routed_experts[mixed][0].tolist()}")
            srt = routed_experts.sort(-1).values
            dup = ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(-1)
            if bool(dup.any()):
                raise ModelInputError(f"routed_experts row repeats an expert: {routed_experts[dup][0].tolist()}")
        if indexer_topk is not None:
            if not cfg.indexed_layers:
                raise ModelInputError("indexer_topk given but the indexer is off (index_topk = 0)")
            _check_trace("indexer_topk", indexer_topk, (b, s, len(cfg.indexed_layers), cfg.index_topk), t)
        return b, s, s_past, key_padding_mask


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {list(x.shape)}"
    return type(x).__name__


def _check_trace(name: str, x, shape: tuple[int, ...], upper: int) -> None:
    """Raise `ModelInputError` unless x is an integer tensor of `shape` with values in [-1, upper)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64) or tuple(x.shape) != shape:
        raise ModelInputError(f"{name} must be an int32/int64 tensor {list(shape)}, got {_desc(x)}")
    if x.numel() and (int(x.min()) < -1 or int(x.max()) >= upper):
        raise ModelInputError(f"{name} values must lie in [-1, {upper}), got [{int(x.min())}, {int(x.max())}]")
