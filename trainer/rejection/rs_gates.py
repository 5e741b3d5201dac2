"""Rejection-sampling (RS) gates on the proximal / behaviour log-ratio.

Written once and used by both the preflight forward (to admit prompt groups for exact refill)
and the training forward (which re-applies the same gate and must reproduce the preflight
masks), so the two can never disagree on a formula.

Per response token ``t`` with loss mask ``m_t`` (docs/design/trainer-math.md#trainer-math)::

    d_t = logp_prox_t - logp_rollout_t
    token gate:      accept exp(d_t)                          in [lower, upper]
    sequence gate:   accept exp(sum_t m_t d_t)                in [lower, upper]
    geometric gate:  accept exp(sum_t m_t d_t / max(sum m, 1)) in [lower, upper]

``m_t`` is 1 exactly at the tokens the engine sampled (the caller passes
:attr:`replayrl.rollout.sample.Sample.sampled_mask`, which is the loss mask without a synthetic EOS).
Tokens with ``m_t = 0`` (prompt, observation, padding, a synthetic EOS) never influence a gate,
neither a sum nor the token count of the geometric mean; their ``d_t`` may be NaN or inf (the
rollout logprob of an observation slot or of an appended EOS is undefined). Sums are taken in
float64 so the weight does not depend on summation order at float32 resolution. The sequence
and geometric gates are one implementation, :func:`sample_gate`, parameterised by the weight
function (:data:`SAMPLE_LOG_WEIGHTS`).

Sources: token / sequence truncated importance sampling and rejection sampling for
train-inference mismatch (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"; verl rollout-correction and slime "RS" options); the geometric mean
variant is the per-token-normalised sequence ratio (GSPO, Zheng et al. 2025).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType

import torch
from torch import Tensor

from replayrl.trainer.errors import RSBoundsError, RSError

__all__ = [
    "compute_log_ratio",
    "token_gate",
    "sequence_log_weight",
    "geometric_log_weight",
    "SampleLogWeight",
    "SAMPLE_LOG_WEIGHTS",
    "sample_gate",
    "group_admission",
]


# --------------------------------------------------------------------------- validation


def _check_bounds(lower: float, upper: float) -> tuple[float, float]:
    lo, hi = float(lower), float(upper)
    if math.isnan(lo) or math.isnan(hi):
        raise RSBoundsError(f"RS bounds must not be NaN, got lower={lower!r}, upper={upper!r}")
    if lo <= 0.0 or hi <= 0.0:
        raise RSBoundsError(
            f"RS bounds are ratios and must be > 0, got lower={lower!r}, upper={upper!r}"
        )
    if math.isinf(lo):
        raise RSBoundsError(f"RS lower bound must be finite, got {lower!r}")
    if lo > hi:
        raise RSBoundsError(f"RS lower bound {lower!r} exceeds upper bound {upper!r}")
    return lo, hi


def _mask_bool(loss_mask: Tensor, n: int, what: str) -> Tensor:
    if not isinstance(loss_mask, Tensor) or loss_mask.dim() != 1:
        raise RSError(f"{what}loss_mask must be a 1-D tensor, got {type(loss_mask).__name__}")
    if loss_mask.shape[0] != n:
        raise RSError(f"{what}loss_mask has {loss_mask.shape[0]} entries, log_ratio has {n}")
    if loss_mask.dtype == torch.bool:
        return loss_mask
    bad = (loss_mask != 0) & (loss_mask != 1)
    if bool(bad.any()):
        idx = torch.nonzero(bad).flatten().tolist()
        raise RSError(f"{what}loss_mask must hold only 0/1, bad positions {idx[:8]}")
    return loss_mask != 0


def _check_ratio(log_ratio: Tensor, what: str) -> None:
    if not isinstance(log_ratio, Tensor) or log_ratio.dim() != 1 or not log_ratio.is_floating_point():
        raise RSError(f"{what}log_ratio must be a 1-D float tensor, got "
                      f"{type(log_ratio).__name__}")


def _masked_ratio(log_ratio: Tensor, mask: Tensor, what: str) -> Tensor:
    """float64 ``d`` with non-loss positions set to 0; non-finite at a loss token raises."""
    d = log_ratio.double()
    bad = mask & ~torch.isfinite(d)
    if bool(bad.any()):
        idx = torch.nonzero(bad).flatten().tolist()
        raise RSError(f"{what}non-finite log_ratio at loss tokens {idx[:8]}")
    # torch.where, not multiplication: NaN * 0 is NaN.
    return torch.where(mask, d, torch.zeros_like(d))


def _segments(
    log_ratio: Tensor | Sequence[Tensor],
    loss_mask: Tensor | Sequence[Tensor],
    cu_seqlens: Tensor | Sequence[int] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Flatten per-sample inputs; return (masked float64 d [N], bool mask [N], lengths [B])."""
    if isinstance(log_ratio, Tensor):
        if cu_seqlens is None:
            raise RSError("a packed log_ratio tensor needs cu_seqlens (sample boundaries)")
        _check_ratio(log_ratio, "")
        mask = _mask_bool(loss_mask, log_ratio.shape[0], "")
        cu = torch.as_tensor(cu_seqlens)
        if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
            raise RSError(f"cu_seqlens must be a 1-D integer tensor, got {cu!r}")
        cu = cu.to(torch.long)
        lengths = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != log_ratio.shape[0] or bool((lengths < 0).any()):
            raise RSError(
                f"cu_seqlens must rise from 0 to {log_ratio.shape[0]} (the number of tokens), "
                f"got {cu.tolist()}"
            )
        d = log_ratio
    else:
        if cu_seqlens is not None:
            raise RSError("cu_seqlens is only for a packed log_ratio tensor, not a per-sample list")
        if isinstance(loss_mask, Tensor) or len(loss_mask) != len(log_ratio):
            raise RSError(
                f"per-sample log_ratio needs a per-sample loss_mask list of the same length "
                f"({len(log_ratio)} samples)"
            )
        masks, ratios = [], []
        for i, (lr, lm) in enumerate(zip(log_ratio, loss_mask)):
            lr = torch.as_tensor(lr, dtype=torch.float64) if not isinstance(lr, Tensor) else lr
            lm = torch.as_tensor(lm) if not isinstance(lm, Tensor) else lm
            _check_ratio(lr, f"sample {i}: ")
            masks.append(_mask_bool(lm, lr.shape[0], f"sample {i}: "))
            ratios.append(lr.double())
        lengths = torch.tensor([r.shape[0] for r in ratios], dtype=torch.long)
        d = torch.cat(ratios) if ratios else torch.zeros(0, dtype=torch.float64)
        mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.cpu()).to(d.device)
    bad = mask & ~torch.isfinite(d)
    if bool(bad.any()):
        samples = sorted(set(seg[bad].tolist()))
        raise RSError(f"non-finite log_ratio at loss tokens of samples {samples[:8]}")
    return torch.where(mask, d.double(), torch.zeros_like(d, dtype=torch.float64)), mask, lengths.to(d.device)


def _segment_sums(d: Tensor, mask: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=d.device), lengths)
    sums = torch.zeros(lengths.numel(), dtype=torch.float64, device=d.device).index_add_(0, seg, d)
    counts = torch.zeros(lengths.numel(), dtype=torch.float64, device=d.device).index_add_(
        0, seg, mask.double()
    )
    return sums, counts


def _in_bounds(log_weight: Tensor, lo: float, hi: float) -> Tensor:
    w = log_weight.double().exp()
    return (w >= lo) & (w <= hi)


# --------------------------------------------------------------------------- public API


def compute_log_ratio(logp_prox: Tensor, logp_rollout: Tensor, loss_mask: Tensor) -> Tensor:
    """``d = logp_prox - logp_rollout`` at loss tokens, 0 elsewhere (float32 [N], detached).

    Args:
        logp_prox: float tensor [N], proximal logprobs (preflight forward, nats).
        logp_rollout: float tensor [N], behaviour logprobs recorded by the engine (nats); may
            hold NaN / inf where ``loss_mask`` is 0.
        loss_mask: tensor [N] of 0/1 (bool or integer or float).

    Raises:
        RSError: mismatched shapes, a mask value other than 0/1, or a non-finite ratio at a
            loss token (naming the positions).
    """
    _check_ratio(logp_prox, "logp_prox as ")
    _check_ratio(logp_rollout, "logp_rollout as ")
    if logp_prox.shape != logp_rollout.shape:
        raise RSError(f"logp_prox {tuple(logp_prox.shape)} and logp_rollout "
                      f"{tuple(logp_rollout.shape)} differ in shape")
    mask = _mask_bool(loss_mask, logp_prox.shape[0], "")
    d = logp_prox.detach().float() - logp_rollout.detach().float()
    bad = mask & ~torch.isfinite(d)
    if bool(bad.any()):
        idx = torch.nonzero(bad).flatten().tolist()
        raise RSError(f"non-finite logp_prox - logp_rollout at loss tokens {idx[:8]}")
    return torch.where(mask, d, torch.zeros_like(d))


def token_gate(log_ratio: Tensor, loss_mask: Tensor, lower: float, upper: float) -> Tensor:
    """Token RS: accept token ``t`` iff ``exp(d_t)`` lies in ``[lower, upper]``.

    Args:
        log_ratio: float tensor [N] of ``d = logp_prox - logp_rollout`` (nats).
        loss_mask: tensor [N] of 0/1; masked tokens are accepted whatever ``d`` holds.
        lower, upper: ratio bounds, ``0 < lower <= upper`` (``upper`` may be inf).

    Returns:
        bool tensor [N] (True = accepted).

    Raises:
        RSBoundsError: bad bounds. RSError: bad shapes / mask, non-finite ``d`` at a loss token.
    """
    lo, hi = _check_bounds(lower, upper)
    _check_ratio(log_ratio, "")
    mask = _mask_bool(loss_mask, log_ratio.shape[0], "")
    d = _masked_ratio(log_ratio, mask, "")
    return ~mask | _in_bounds(d, lo, hi)


def sequence_log_weight(
    log_ratio: Tensor | Sequence[Tensor],
    loss_mask: Tensor | Sequence[Tensor],
    *,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """Per-sample log sequence weight ``sum_t m_t d_t`` (float64 [B], nats).

    Samples are given either packed (``log_ratio`` [N], ``loss_mask`` [N] and ``cu_seqlens``
    [B+1], the sample boundaries) or as per-sample lists of 1-D tensors.

    Raises:
        RSError: bad shapes / boundaries / mask, or non-finite ``d`` at a loss token (naming
            the sample index).
    """
    d, mask, lengths = _segments(log_ratio, loss_mask, cu_seqlens)
    return _segment_sums(d, mask, lengths)[0]


def geometric_log_weight(
    log_ratio: Tensor | Sequence[Tensor],
    loss_mask: Tensor | Sequence[Tensor],
    *,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """Per-sample log geometric-mean weight ``sum_t m_t d_t / max(sum_t m_t, 1)`` (float64 [B]).

    A sample with no loss token gets 0 (weight 1). Inputs as :func:`sequence_log_weight`.

    Raises:
        RSError: as :func:`sequence_log_weight`.
    """
    d, mask, lengths = _segments(log_ratio, loss_mask, cu_seqlens)
    sums, counts = _segment_sums(d, mask, lengths)
    return sums / counts.clamp(min=1.0)  # max(sum m, 1) by definition, not a data clamp


SampleLogWeight = Callable[..., Tensor]
"""A per-sample log weight: ``(log_ratio, loss_mask, *, cu_seqlens=None) -> float64 [B]`` (nats),
inputs as :func:`sequence_log_weight`."""

SAMPLE_LOG_WEIGHTS: Mapping[str, SampleLogWeight] = MappingProxyType({
    "sequence": sequence_log_weight,
    "geometric": geometric_log_weight,
})
"""The sample gates' weight functions by ``--rs-mode`` name (read-only)."""


def sample_gate(
    log_ratio: Tensor | Sequence[Tensor],
    loss_mask: Tensor | Sequence[Tensor],
    lower: float,
    upper: float,
    *,
    log_weight: SampleLogWeight,
    cu_seqlens: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """Sample RS: accept sample ``b`` iff ``exp(log_weight(d, m)[b])`` lies in ``[lower, upper]``.

    The sequence gate is ``log_weight=sequence_log_weight`` (``exp(sum m d)``), the geometric
    gate ``log_weight=geometric_log_weight`` (``exp(sum m d / max(sum m, 1))``); the two differ
    only in that function (:data:`SAMPLE_LOG_WEIGHTS`).

    Args:
        log_ratio, loss_mask, cu_seqlens: as :func:`sequence_log_weight` (packed with
            ``cu_seqlens`` [B+1], or per-sample lists of 1-D tensors).
        lower, upper: ratio bounds, ``0 < lower <= upper`` (``upper`` may be inf); inclusive.
        log_weight: the per-sample log weight, e.g. a value of :data:`SAMPLE_LOG_WEIGHTS`.

    Returns:
        bool tensor [B] (True = accepted).

    Raises:
        RSBoundsError: bad bounds (checked first). RSError: as :func:`sequence_log_weight`.
    """
    lo, hi = _check_bounds(lower, upper)
    return _in_bounds(log_weight(log_ratio, loss_mask, cu_seqlens=cu_seqlens), lo, hi)


def group_admission(
    sample_accept: Sequence[bool] | Tensor,
    group_ids: Sequence[Hashable],
    *,
    n_samples_per_prompt: int | None = None,
) -> dict[Hashable, bool]:
    """Group-atomic admission: a prompt group is admitted only if every sample passes.

    Args:
        sample_accept: per-sample gate results [B] (bools or a bool tensor).
        group_ids: per-sample prompt-group id [B] (any hashable).
        n_samples_per_prompt: when given, every group must hold exactly this many samples
            (a partial group would otherwise be admitted on incomplete evidence).

    Returns:
        ``{group_id: admitted}`` in order of first appearance.

    Raises:
        RSError: length mismatch, a non-bool accept value, or a group of the wrong size
            (naming the group).
    """
    accept = sample_accept.tolist() if isinstance(sample_accept, Tensor) else list(sample_accept)
    ids = list(group_ids)
    if len(accept) != len(ids):
        raise RSError(f"{len(accept)} accept flags for {len(ids)} group ids")
    admitted: dict[Hashable, bool] = {}
    sizes: dict[Hashable, int] = {}
    for i, (ok, gid) in enumerate(zip(accept, ids)):
        if not isinstance(ok, bool):
            raise RSError(f"sample {i} (group {gid!r}): accept flag must be a bool, got {ok!r}")
        admitted[gid] = admitted.get(gid, True) and ok
        sizes[gid] = sizes.get(gid, 0) + 1
    if n_samples_per_prompt is not None:
        wrong = {g: c for g, c in sizes.items() if c != n_samples_per_prompt}
        if wrong:
            raise RSError(
                f"prompt groups with a sample count other than n_samples_per_prompt="
                f"{n_samples_per_prompt}: {wrong}"
            )
    return admitted
