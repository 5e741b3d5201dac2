"""DSA-style sparse-attention indexer (simplified DeepSeek-V3.2 "lightning indexer").

Source: DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek Sparse
Attention" (2025). The indexer scores query token i against key token j as

    I(i, j) = sum_h w_h(i) * relu(q_h(i) . k(j))

with `q_h = wq(x)` split into `index_n_heads` heads of `index_head_dim`, one shared key
`k = wk(x)` and per-head weights `w = weights_proj(x)`, where x is the attention input (after
input_layernorm). Each query keeps the `index_topk` causal, non-padding keys with the highest score
and the layer's attention is restricted to them. Simplifications against DeepSeek: no RoPE, no
LayerNorm on k, no FP8 and no weight scaling (a positive scale would not change the ranking).

Ties (common: relu makes many scores exactly 0) go to the more recent key, so the choice is a
function of token order alone and agrees between left-padded (engine) and right-padded (trainer)
layouts. Scores are computed in float32 whatever the model dtype.

Top-k is not differentiable: the indexer's parameters get no gradient (requires_grad False, and
the scores are computed under no_grad). DeepSeek trains the indexer with a separate KL loss
against the dense attention distribution; replayrl replays the engine's picks instead.
"""

from __future__ import annotations

import torch
from torch import nn

from replayrl.rollout.model.errors import ModelInputError


class Indexer(nn.Module):
    """Lightning-indexer scorer of one attention layer.

    Parameters (HF-style names under `model.layers.{i}.self_attn.indexer.`): `wq.weight`
    `[n_heads * head_dim, hidden]`, `wk.weight` `[head_dim, hidden]`, `weights_proj.weight`
    `[n_heads, hidden]`; all frozen (requires_grad False).
    """

    def __init__(self, hidden_size: int, n_heads: int, head_dim: int, topk: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.topk = topk
        self.wq = nn.Linear(hidden_size, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """Indexer keys `[B, S, head_dim]` (model dtype) of attention inputs x `[B, S, hidden]`."""
        with torch.no_grad():
            return self.wk(x)

    def scores(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Scores I(i, j), float32 `[B, S, T]`, of queries x `[B, S, hidden]` against keys `[B, T, head_dim]`."""
        with torch.no_grad():
            b, s, _ = x.shape
            q = self.wq(x).view(b, s, self.n_heads, self.head_dim).float()
            w = self.weights_proj(x).float()
            dots = torch.einsum("bshd,btd->bsht", q, keys.float()).relu()
            return torch.einsum("bsht,bsh->bst", dots, w)


def select_topk(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """Key slots of the top-`k` candidate keys per query, int64 `[B, S, k]`, -1 = no key.

    `scores`: float `[B, S, T]`; `candidates`: bool `[B, S, T]` (causal and not padding).
    A row lists its picks by decreasing score, ties to the larger slot (more recent key); a query
    with fewer than `k` candidates lists all of them and fills the rest with -1.

    One `torch.topk` over a unique int64 key per (query, slot), `_ranking_keys`, instead of a
    full sort over every key: the same picks in the same order (a stable descending sort of the
    reversed key axis, which this replaced), without sorting the T - k keys nobody keeps.
    """
    b, s, t = scores.shape
    masked = scores.float().masked_fill(~candidates, float("-inf"))
    slots = torch.topk(_ranking_keys(masked), min(k, t), dim=-1).indices
    slots = torch.where(candidates.gather(-1, slots), slots, torch.full_like(slots, -1))
    if t < k:
        slots = torch.cat([slots, slots.new_full((b, s, k - t), -1)], dim=-1)
    return slots


def _ranking_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 `[..., T]`, ordered as (score, slot) lexicographically, of float32 `scores` `[..., T]`.

    The float32 bit pattern read as int32 orders non-negative floats; flipping the magnitude bits
    of the negative ones orders those too (IEEE 754 total order, -inf lowest). Adding 0.0 first
    turns -0.0 into +0.0, which the sort counted as equal. Times T plus the slot: equal scores
    order by slot, so the larger slot ranks higher, as the tie rule says. No NaN may occur.
    """
    t = scores.shape[-1]
    bits = (scores + 0.0).view(torch.int32)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    return order * t + torch.arange(t, device=scores.device)


def slots_to_mask(slots: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Bool mask `[B, S, num_keys]`, True at every slot of `slots` (int `[B, S, k]`, -1 ignored)."""
    b, s, _ = slots.shape
    mask = torch.zeros(b, s, num_keys + 1, dtype=torch.bool, device=slots.device)
    # -1 is routed to an extra column that is dropped, so no clamping of real slots happens.
    mask.scatter_(-1, torch.where(slots >= 0, slots, num_keys).long(), True)
    return mask[..., :num_keys]


def resolve_replay(own: torch.Tensor | None, replay: torch.Tensor | None, allowed: torch.Tensor,
                   layer: int) -> torch.Tensor:
    """Key slots the layer attends to: the replayed ones, or `own` on all -1 replay rows.

    `own`: int64 `[B, S, k]` from `select_topk`, or None when no query that has keys to pick
    from has an all -1 replay row (such rows stay -1, as `select_topk` leaves them);
    `replay`: int `[B, S, k]` in [-1, T) (range
    already checked by the caller) or None; `allowed`: bool `[B, S, T]` causal, non-padding keys.
    A replay row of only -1 means "no replay for this token" (padding, observation rows).
    Raises `ModelInputError` naming the layer if a replayed slot is padding or in the future.
    """
    if replay is None:
        return own
    replay = replay.long()
    picked = replay >= 0
    ok = allowed.gather(-1, torch.where(picked, replay, 0))
    if bool((picked & ~ok).any()):
        b, i, _ = torch.nonzero(picked & ~ok)[0].tolist()
        raise ModelInputError(
            f"indexer_topk replays a padding or non-causal key slot for layer {layer} at batch "
            f"row {b}, query {i}: {replay[b, i].tolist()}")
    if own is None:
        return replay
    use_own = ~picked.any(-1, keepdim=True)
    return torch.where(use_own, own, replay)


def _slot_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` `[B, H_kv, T, D]` as a `[R, D]` view of rows and the rows between one (batch, head)
    and the next: row ``(b * H_kv + h) * stride + t`` is ``x[b, h, t]``. A KV cache's keys are a
    slice of a buffer with spare slots (rollout/model/kv_cache.py ``append_along``): viewed in
    place over the whole buffer, not copied by a reshape (O(B T) a decode token); any other
    layout is made contiguous."""
    b, h, t, d = x.shape
    if (x.stride(3) == 1 and x.stride(2) == d and x.stride(1) % d == 0 and x.stride(1) >= t * d
            and x.stride(0) == h * x.stride(1)):
        rows = b * h * (x.stride(1) // d)
        if x.storage_offset() + rows * d <= x.untyped_storage().nbytes() // x.element_size():
            return x.as_strided((rows, d), (d, 1)), x.stride(1) // d
    return x.contiguous().view(-1, d), t


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                       own_slot: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of each query over only its indexer-kept keys, gathered instead of masked.

    q `[B, H, S, D]`, k and v `[B, H_kv, T, D]` (H a multiple of H_kv: grouped-query
    attention), slots int64 `[B, S, k]` key slots in [0, T) or -1 (none), own_slot int64
    `[S]` each query's own slot. Returns `[B, H, S, D]` in q's dtype (a transposed view of a
    contiguous `[B, S, H, D]`): softmax(scale q.k) over
    the distinct kept slots of the query (its own slot alone when it keeps none, as the masked
    path attends a padding query to itself), weighted sum of their values; scores and softmax
    in float32. The same function as `scaled_dot_product_attention` with the boolean mask of
    `slots_to_mask` (up to float rounding: sums in another order), in O(S k) instead of O(S T)
    work and memory.
    """
    b, h, s, d = q.shape
    h_kv = k.shape[1]
    kept = slots >= 0
    # a slot listed twice counts once, as in the mask
    repeat = ((slots[..., :, None] == slots[..., None, :]) & kept[..., None, :]).triu(1).any(-2)
    kept = kept & ~repeat
    none = ~kept.any(-1, keepdim=True)
    first = torch.zeros_like(kept)
    first[..., 0] = True
    slots = torch.where(none & first, own_slot[None, :, None].expand_as(slots), slots)
    kept = kept | (none & first)
    # flat row of key (batch, kv head, slot) in k.reshape(B * H_kv * T, D), gathered in
    # (batch, query, kv head, kept key) order: the query-major layout is the one q arrives in
    # (a transposed [B, S, H, D]) and the one the caller transposes the output back to, so one
    # batched matmul per product needs no permuting copies of the gathered keys or the output
    # (einsum over [B, H, S, D] made three; the same products, bit for bit)
    g, kk = h // h_kv, slots.shape[-1]
    heads = torch.arange(b, device=q.device)[:, None] * h_kv + torch.arange(h_kv, device=q.device)
    picked = slots.clamp_min(0)[:, :, None, :]
    k_rows, k_slots = _slot_rows(k)
    v_rows, v_slots = _slot_rows(v)
    k_sel = k_rows.index_select(0, (heads[:, None, :, None] * k_slots + picked).reshape(-1)).view(-1, kk, d)
    v_sel = v_rows.index_select(0, (heads[:, None, :, None] * v_slots + picked).reshape(-1)).view(-1, kk, d)
    qg = q.transpose(1, 2).reshape(-1, g, d)  # [B * S * H_kv, g, D]
    logits = torch.bmm(qg.float(), k_sel.float().transpose(1, 2)) * scale
    logits = logits.view(b, s, h_kv, g, kk).masked_fill(~kept[:, :, None, None], float("-inf"))
    weights = torch.softmax(logits, dim=-1).view(-1, g, kk)
    out = torch.bmm(weights, v_sel.float())  # [B * S * H_kv, g, D]
    return out.view(b, s, h, d).to(q.dtype).transpose(1, 2)

