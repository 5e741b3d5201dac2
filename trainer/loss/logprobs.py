"""Trainer logprob paths: full vocabulary, support replay, fused chunked LM head.

The rollout engine samples from a *processed* distribution (temperature, then top-k / top-p /
min-p truncation). Its captured ``sample_support`` row for a response token ``t`` is an int32
row ``[y_t, c_1, ..., c_K]``: column 0 is the sampled id, columns 1.. the candidate ids that
survived truncation, ``-1`` = excluded. Support replay renormalises the trainer's logits over
exactly that set (docs/design/trainer-math.md#trainer-math)::

    log p~(y_t) = z_y - logsumexp_{v in S_t} z_v,   z = logits / temperature

Row kinds, decided from the row alone so that every shape depends only on ``N`` and ``K``:

* support row: column 0 >= 0 and at least one candidate; ``y`` must be one of the candidates.
* synthetic-EOS fallback row: column 0 >= 0 and every candidate ``-1`` (an EOS appended after
  truncation has no captured support); its value is the full-vocabulary logprob of ``y``.
* padding / observation row: column 0 == -1 (and then every candidate must be -1 too);
  its value is 0 and it receives no gradient.

Every function returns float32 computed in float32 whatever the float dtype of the inputs
(the trainer may hold bf16 logits; the loss is computed in float32).

Fallback slots. A fallback row needs the whole vocabulary row while every other row needs only
``1+K`` logits. The caller may pass ``fallback_rows``, a fixed index set (one slot per
trajectory, e.g. each trajectory's last response row, per docs/design/trainer-math.md#trainer-math)
that must cover every fallback row; the full-vocabulary work then has shape ``[len(fallback_rows),
V]`` whatever the data, and non-fallback slots are computed and discarded. Without it the slots are
the flagged rows themselves (a data-dependent count).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from replayrl.trainer.errors import LogprobError, SupportError

__all__ = [
    "full_vocab_logprobs",
    "support_logprobs",
    "support_entropy",
    "fused_support_logprobs",
]


# --------------------------------------------------------------------------- validation


def _check_temperature(temperature: float) -> float:
    try:
        t = float(temperature)
    except (TypeError, ValueError) as exc:
        raise LogprobError(f"temperature must be a number, got {temperature!r}") from exc
    if not math.isfinite(t) or t <= 0.0:
        raise LogprobError(f"temperature must be finite and > 0, got {temperature!r}")
    return t


def _check_logits(logits: Tensor, name: str = "logits") -> None:
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        raise LogprobError(f"{name} must be a 2-D tensor [N, V], got {_describe(logits)}")
    if not logits.is_floating_point():
        raise LogprobError(f"{name} must be a float tensor, got dtype {logits.dtype}")
    if logits.shape[1] == 0:
        raise LogprobError(f"{name} has an empty vocabulary dimension: shape {tuple(logits.shape)}")


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


def _rows(mask: Tensor, limit: int = 8) -> str:
    """Indices of the True entries of a [N] bool mask, for error messages."""
    idx = torch.nonzero(mask).flatten().tolist()
    more = f" (and {len(idx) - limit} more)" if len(idx) > limit else ""
    return f"{idx[:limit]}{more}"


class _RowKinds:
    """Per-row classification of a validated support tensor (all [N] or [N,K] bool)."""

    __slots__ = ("pad", "fallback", "cand_valid", "lse_mask", "ids")

    def __init__(self, support: Tensor):
        y = support[:, 0]
        cand = support[:, 1:]
        self.cand_valid = cand >= 0  # [N, K]
        has_cand = self.cand_valid.any(dim=1)
        self.pad = y < 0
        self.fallback = ~self.pad & ~has_cand
        # Rows without candidates (fallback, padding) get one dummy "valid" column pointing at
        # id 0 so their support logsumexp stays finite: an all -inf row would give NaN
        # gradients (0 * NaN) even though torch.where discards its value.
        lse_mask = self.cand_valid.clone()
        if lse_mask.shape[1] > 0:
            lse_mask[:, 0] |= ~has_cand
        self.lse_mask = lse_mask
        # Gather-safe ids: -1 becomes 0; those slots are masked out of every result.
        self.ids = torch.where(support >= 0, support, torch.zeros_like(support)).long()


def _validate_support(
    support: Tensor, n_rows: int, vocab_size: int, device: torch.device
) -> _RowKinds:
    """Check a ``sample_support`` tensor against ``N`` rows and a vocabulary of ``vocab_size``.

    Raises SupportError naming the offending rows for: wrong shape / dtype, ids outside
    ``[-1, V)``, a padding row (column 0 == -1) with candidates, a duplicated candidate, and a
    sampled id missing from its row's candidates (fallback rows excepted).
    """
    if not isinstance(support, Tensor) or support.dim() != 2 or support.shape[1] < 1:
        raise SupportError(f"support must be a 2-D tensor [N, 1+K], got {_describe(support)}")
    if support.dtype.is_floating_point or support.dtype.is_complex or support.dtype == torch.bool:
        raise SupportError(f"support must be an integer tensor, got dtype {support.dtype}")
    if support.shape[0] != n_rows:
        raise SupportError(
            f"support has {support.shape[0]} rows but the logits/hidden have {n_rows} rows"
        )
    support = support.to(device)
    out_of_range = ((support < -1) | (support >= vocab_size)).any(dim=1)
    if bool(out_of_range.any()):
        raise SupportError(
            f"support ids outside [-1, {vocab_size}) in rows {_rows(out_of_range)}"
        )
    kinds = _RowKinds(support)
    bad_pad = kinds.pad & kinds.cand_valid.any(dim=1)
    if bool(bad_pad.any()):
        raise SupportError(
            f"rows {_rows(bad_pad)} have no sampled id (column 0 == -1) but list candidates"
        )
    if support.shape[1] > 2:
        srt = support[:, 1:].sort(dim=1).values
        dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(dim=1)
        if bool(dup.any()):
            # A repeated candidate would be counted twice in the logsumexp.
            raise SupportError(f"duplicate candidate ids in support rows {_rows(dup)}")
    present = (support[:, 1:] == support[:, :1]).any(dim=1)
    missing = ~kinds.pad & ~kinds.fallback & ~present
    if bool(missing.any()):
        raise SupportError(
            f"sampled id (column 0) is not among the candidates in support rows {_rows(missing)}"
        )
    return kinds


def _fallback_slots(kinds: _RowKinds, fallback_rows: Tensor | None, n_rows: int) -> Tensor:
    """Indices [F] of the rows whose full-vocabulary logsumexp is computed."""
    device = kinds.pad.device
    if fallback_rows is None:
        return torch.nonzero(kinds.fallback).flatten()
    if not isinstance(fallback_rows, Tensor) or fallback_rows.dim() != 1:
        raise SupportError(f"fallback_rows must be a 1-D tensor, got {_describe(fallback_rows)}")
    if fallback_rows.dtype.is_floating_point or fallback_rows.dtype == torch.bool:
        raise SupportError(f"fallback_rows must be an integer tensor, got {fallback_rows.dtype}")
    slots = fallback_rows.to(device=device, dtype=torch.long)
    if slots.numel() and bool(((slots < 0) | (slots >= n_rows)).any()):
        raise SupportError(f"fallback_rows must lie in [0, {n_rows}), got {slots.tolist()}")
    if slots.unique().numel() != slots.numel():
        raise SupportError(f"fallback_rows has repeated rows: {slots.tolist()}")
    covered = torch.zeros(n_rows, dtype=torch.bool, device=device)
    covered[slots] = True
    uncovered = kinds.fallback & ~covered
    if bool(uncovered.any()):
        raise SupportError(
            f"synthetic-EOS fallback rows {_rows(uncovered)} (all candidates -1) are not in "
            f"fallback_rows"
        )
    return slots


def _check_chunk(chunk_size: int, name: str = "chunk_size") -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise LogprobError(f"{name} must be a positive int, got {chunk_size!r}")
    return chunk_size


# --------------------------------------------------------------------------- full vocabulary


def full_vocab_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """Full-vocabulary logprob of each target: ``log_softmax(logits / T)[n, targets[n]]``.

    Args:
        logits: float tensor [N, V] of any float dtype (raw LM-head output, no temperature).
        targets: integer tensor [N] of token ids in ``[0, V)``; ``-1`` = no target (e.g. the
            last position of a packed segment), giving 0 with no gradient.
        temperature: sampling temperature ``T > 0`` (dimensionless).

    Returns:
        float32 tensor [N] of natural-log probabilities, computed in float32.

    Raises:
        LogprobError: bad shapes/dtypes, a target outside ``[-1, V)``, or a bad temperature.
    """
    _check_logits(logits)
    t = _check_temperature(temperature)
    if not isinstance(targets, Tensor) or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise LogprobError(
            f"targets must be a 1-D tensor with {logits.shape[0]} entries, got {_describe(targets)}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise LogprobError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    vocab = logits.shape[1]
    bad = (targets < -1) | (targets >= vocab)
    if bool(bad.any()):
        raise LogprobError(f"targets outside [-1, {vocab}) at rows {_rows(bad)}")
    valid = targets >= 0
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    z = logits.float() / t
    lp = z.gather(1, safe[:, None]).squeeze(1) - torch.logsumexp(z, dim=1)
    return torch.where(valid, lp, torch.zeros_like(lp))


# --------------------------------------------------------------------------- support replay


def _support_lse(z_cand: Tensor, lse_mask: Tensor) -> Tensor:
    """logsumexp over the masked candidate columns of z_cand [N, K] -> [N] (0 when K == 0)."""
    if z_cand.shape[1] == 0:
        return z_cand.new_zeros(z_cand.shape[0])
    return torch.logsumexp(z_cand.masked_fill(~lse_mask, float("-inf")), dim=1)


def support_logprobs(
    logits: Tensor,
    support: Tensor,
    temperature: float,
    *,
    fallback_rows: Tensor | None = None,
) -> Tensor:
    """Support-replay logprob ``z_y - logsumexp_{v in S} z_v`` with ``z = logits / T``.

    Only ``[N, 1+K]`` logits are gathered (fixed shape, no Python loop over rows, no boolean
    compaction of the support); the ``[N, V]`` logits are read, never copied to float32, except
    for the fallback slots.

    Args:
        logits: float tensor [N, V] of any float dtype.
        support: integer tensor [N, 1+K] (``sample_support``): column 0 sampled id ``y``,
            columns 1.. candidate ids, ``-1`` = excluded.
        temperature: sampling temperature ``T > 0`` the engine applied before truncation.
        fallback_rows: optional integer tensor [F] of row indices (unique) covering every
            synthetic-EOS fallback row; fixes the shape of the full-vocabulary work (see the
            module docstring). Default: the fallback rows themselves.

    Returns:
        float32 tensor [N]: support logprob for support rows, full-vocabulary logprob for
        fallback rows, 0 (no gradient) for padding rows (column 0 == -1).

    Raises:
        SupportError: an inconsistent support row (named by index), e.g. a sampled id that is
            not among its row's candidates, or a fallback row missing from ``fallback_rows``.
        LogprobError: bad shapes/dtypes or temperature.

    Source: docs/design/trainer-math.md#trainer-math (support replay of the engine's truncated sampler).
    """
    _check_logits(logits)
    t = _check_temperature(temperature)
    kinds = _validate_support(support, logits.shape[0], logits.shape[1], logits.device)
    slots = _fallback_slots(kinds, fallback_rows, logits.shape[0])
    ids = kinds.ids
    # Gather before casting so bf16 logits are never copied whole into float32.
    z = logits.gather(1, ids).float() / t  # [N, 1+K]
    lse = _support_lse(z[:, 1:], kinds.lse_mask)
    if slots.numel():
        lse_full = torch.logsumexp(logits[slots].float() / t, dim=1)
        lse = lse.index_put((slots,), torch.where(kinds.fallback[slots], lse_full, lse[slots]))
    lp = z[:, 0] - lse
    return torch.where(kinds.pad, torch.zeros_like(lp), lp)


def support_entropy(
    logits: Tensor,
    support: Tensor,
    temperature: float,
    *,
    fallback_rows: Tensor | None = None,
) -> Tensor:
    """Entropy (nats) of the distribution renormalised over each row's support.

    ``H_t = -sum_{v in S_t} p~_v log p~_v`` with ``p~ = softmax over S_t of logits / T``.
    Fallback rows use the full-vocabulary entropy; padding rows give 0 with no gradient.

    Args:
        logits: float tensor [N, V] of any float dtype.
        support: integer tensor [N, 1+K] as in :func:`support_logprobs` (column 0 is checked
            for consistency but does not enter the entropy).
        temperature: ``T > 0``.
        fallback_rows: optional fixed fallback slots, as in :func:`support_logprobs`.

    Returns:
        float32 tensor [N] of entropies in nats.

    Raises:
        SupportError, LogprobError: as :func:`support_logprobs`.
    """
    _check_logits(logits)
    t = _check_temperature(temperature)
    kinds = _validate_support(support, logits.shape[0], logits.shape[1], logits.device)
    slots = _fallback_slots(kinds, fallback_rows, logits.shape[0])
    ids = kinds.ids[:, 1:]
    z = logits.gather(1, ids).float() / t  # [N, K]
    lse = _support_lse(z, kinds.lse_mask)
    # Masked columns are zeroed *before* the product: 0 * (-inf) would poison the gradient.
    logp = torch.where(kinds.lse_mask, z - lse[:, None], torch.zeros_like(z))
    p = torch.where(kinds.lse_mask, logp.exp(), torch.zeros_like(z))
    ent = -(p * logp).sum(dim=1)
    if slots.numel():
        logp_full = torch.log_softmax(logits[slots].float() / t, dim=1)
        finite = torch.isfinite(logp_full)
        logp_safe = torch.where(finite, logp_full, torch.zeros_like(logp_full))
        ent_full = -(logp_full.exp() * logp_safe).sum(dim=1)
        ent = ent.index_put((slots,), torch.where(kinds.fallback[slots], ent_full, ent[slots]))
    return torch.where(kinds.pad, torch.zeros_like(ent), ent)


# --------------------------------------------------------------------------- fused LM head


def _full_vocab_lse_rows(
    h_rows: Tensor, weight: Tensor, t: float, chunk_size: int, vocab_chunk: int
) -> Tensor:
    """logsumexp over the whole vocabulary of ``(h_rows @ weight.T) / t`` -> float32 [F].

    Rows in chunks of ``chunk_size`` and the vocabulary in blocks of ``vocab_chunk``, so at
    most ``[chunk_size, vocab_chunk]`` logits exist at a time.
    """
    out = h_rows.new_empty(h_rows.shape[0], dtype=torch.float32)
    vocab = weight.shape[0]
    for r0 in range(0, h_rows.shape[0], chunk_size):
        hf = h_rows[r0 : r0 + chunk_size].float()
        parts = []
        for v0 in range(0, vocab, vocab_chunk):
            zb = (hf @ weight[v0 : v0 + vocab_chunk].float().T) / t
            parts.append(torch.logsumexp(zb, dim=1))
        out[r0 : r0 + chunk_size] = torch.logsumexp(torch.stack(parts, dim=1), dim=1)
    return out


class _FusedSupportLogprobs(torch.autograd.Function):
    """Support logprobs from hidden states without materialising [N, V] logits.

    Forward and backward both walk row chunks; the backward recomputes the chunk's candidate
    logits from the saved hidden states and weight instead of keeping them, so the largest
    temporary is ``[chunk, 1+K, H]`` (or ``[chunk, vocab_chunk]`` for fallback slots).
    """

    @staticmethod
    def forward(ctx, hidden, weight, ids, cand_valid, lse_mask, pad, fallback, slots, t, chunk, vchunk):
        n = hidden.shape[0]
        zy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        with torch.no_grad():
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                w = weight[ids[s:e]].float()  # [c, 1+K, H]: only the candidate pairs
                z = torch.bmm(w, hidden[s:e].float()[:, :, None]).squeeze(2) / t  # [c, 1+K]
                zy[s:e] = z[:, 0]
                lse[s:e] = _support_lse(z[:, 1:], lse_mask[s:e])
            if slots.numel():
                lse_full = _full_vocab_lse_rows(hidden[slots], weight, t, chunk, vchunk)
                lse[slots] = torch.where(fallback[slots], lse_full, lse[slots])
            out = torch.where(pad, torch.zeros_like(zy), zy - lse)
        ctx.save_for_backward(hidden, weight, ids, cand_valid, pad, fallback, slots, lse)
        ctx.t, ctx.chunk, ctx.vchunk = t, chunk, vchunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, ids, cand_valid, pad, fallback, slots, lse = ctx.saved_tensors
        t, chunk, vchunk = ctx.t, ctx.chunk, ctx.vchunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, hdim = hidden.shape
        # Padding rows get no gradient whatever the upstream gradient holds.
        g = torch.where(pad, torch.zeros_like(lse), grad_out.float())
        grad_h = torch.zeros(n, hdim, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        # d out / d z_y = 1; d out / d z_v = -p_v over the support (or the vocabulary for a
        # fallback row, whose candidates are all invalid); d z / d (h . w) = 1 / t.
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            hf = hidden[s:e].float()
            w = weight[ids[s:e]].float()  # [c, 1+K, H]
            z = torch.bmm(w, hf[:, :, None]).squeeze(2) / t
            p = torch.where(cand_valid[s:e], (z[:, 1:] - lse[s:e, None]).exp(), torch.zeros_like(z[:, 1:]))
            coef = torch.cat([torch.ones_like(z[:, :1]), -p], dim=1) * (g[s:e, None] / t)
            if need_h:
                grad_h[s:e] = torch.bmm(coef[:, None, :], w).squeeze(1)
            if need_w:
                grad_w.index_add_(0, ids[s:e].reshape(-1), (coef[:, :, None] * hf[:, None, :]).reshape(-1, hdim))
        if slots.numel():
            vocab = weight.shape[0]
            gs = torch.where(fallback[slots], g[slots], torch.zeros_like(g[slots]))
            for r0 in range(0, slots.numel(), chunk):
                rows = slots[r0 : r0 + chunk]
                hf = hidden[rows].float()
                scale = gs[r0 : r0 + chunk, None] / t
                lse_r = lse[rows, None]
                for v0 in range(0, vocab, vchunk):
                    wb = weight[v0 : v0 + vchunk].float()
                    pb = ((hf @ wb.T) / t - lse_r).exp() * scale  # [f, vchunk]
                    if need_h:
                        grad_h.index_add_(0, rows, -(pb @ wb))
                    if need_w:
                        grad_w[v0 : v0 + vchunk] -= pb.T @ hf
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            *([None] * 9),
        )


def fused_support_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    support: Tensor,
    temperature: float,
    chunk_size: int,
    *,
    fallback_rows: Tensor | None = None,
    vocab_chunk_size: int | None = None,
) -> Tensor:
    """Support-replay logprobs straight from hidden states, never materialising [N, V] logits.

    Equal (up to float32 rounding) to
    ``support_logprobs(hidden @ lm_head_weight.T, support, temperature)``. For each chunk of
    rows only the candidate pairs ``(t, v)`` are projected: weight rows are gathered to
    ``[chunk, 1+K, H]`` and contracted with the chunk's hidden states. Fallback slots (see the
    module docstring) compute their full-vocabulary logsumexp in ``[chunk, vocab_chunk_size]``
    blocks. The backward (custom autograd.Function) recomputes per chunk, so peak temporary
    memory is bounded by the chunk, not by ``N x V`` or ``N x K x H``; the gradient
    accumulators are float32 tensors of the shapes of ``hidden`` and ``lm_head_weight``.

    Args:
        hidden: float tensor [N, H], final hidden states (after the last norm) of the rows.
        lm_head_weight: float tensor [V, H], the LM head (logits = hidden @ weight.T, no bias).
        support: integer tensor [N, 1+K] (``sample_support``), as in :func:`support_logprobs`.
        temperature: ``T > 0``.
        chunk_size: rows per chunk (positive int; need not divide N).
        fallback_rows: optional fixed fallback slots [F], as in :func:`support_logprobs`.
        vocab_chunk_size: vocabulary block for fallback slots; default ``chunk_size * (1+K)``
            so a block holds as many weight rows as a row chunk's candidate gather.

    Returns:
        float32 tensor [N], differentiable w.r.t. ``hidden`` and ``lm_head_weight`` (first
        order only); padding rows are 0 with no gradient.

    Raises:
        SupportError, LogprobError: as :func:`support_logprobs`, plus mismatched hidden sizes
            and a non-positive chunk size.

    Source: docs/design/trainer-math.md#trainer-math (fused candidate-pair LM head).
    """
    _check_logits(hidden, "hidden")
    _check_logits(lm_head_weight, "lm_head_weight")
    if hidden.shape[1] != lm_head_weight.shape[1]:
        raise LogprobError(
            f"hidden size mismatch: hidden {tuple(hidden.shape)} vs lm_head_weight "
            f"{tuple(lm_head_weight.shape)}"
        )
    t = _check_temperature(temperature)
    chunk = _check_chunk(chunk_size)
    kinds = _validate_support(support, hidden.shape[0], lm_head_weight.shape[0], hidden.device)
    slots = _fallback_slots(kinds, fallback_rows, hidden.shape[0])
    vchunk = _check_chunk(
        chunk * support.shape[1] if vocab_chunk_size is None else vocab_chunk_size,
        "vocab_chunk_size",
    )
    return _FusedSupportLogprobs.apply(
        hidden,
        lm_head_weight,
        kinds.ids,
        kinds.cand_valid,
        kinds.lse_mask,
        kinds.pad,
        kinds.fallback,
        slots,
        t,
        chunk,
        vchunk,
    )
