"""GRPO advantages: each sample's reward relative to its prompt group.

Source: Shao et al. 2024, "DeepSeekMath" (GRPO, outcome supervision): the advantage of every
token of sample ``i`` in a group is ``(r_i - mean(r_group)) / std(r_group)``; the division by the
group standard deviation is optional here (Liu et al. 2025, "Dr. GRPO", argue for leaving it out).

Under rejection sampling without refill (docs/design/rejection-sampling.md#rejection-sampling) the baseline of
a group is taken over the samples the step trains on (``accepted``), never over a reward the
step threw away; a group with fewer than two of them has no baseline and trains on nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from replayrl.trainer.errors import AdvantageError

__all__ = [ "baseline_groups", "grpo_advantages"]


def _check_accepted(accepted: Tensor, numel: int) -> Tensor:
    if not isinstance(accepted, Tensor) or accepted.dtype != torch.bool or accepted.dim() != 1 \
            or accepted.numel() != numel:
        shape = (f"{accepted.dtype} {tuple(accepted.shape)}" if isinstance(accepted, Tensor)
                 else type(accepted).__name__)
        raise AdvantageError(f"accepted must be a 1-D bool tensor with {numel} entries (one per "
                             f"sample), got {shape}")
    return accepted


def baseline_groups(accepted: Tensor, n_samples_per_prompt: int) -> Tensor:
    """Which prompt groups have a baseline: at least two accepted samples.

    Args:
        accepted: bool tensor [G * n], True = the sample is in its group's baseline (see
            :func:`grpo_advantages`); groups are contiguous runs of ``n`` samples.
        n_samples_per_prompt: group size ``n >= 1``.

    Returns:
        bool tensor [G]; a group with one accepted sample or none is False (degenerate: its
        advantages are 0 and the step trains on none of its tokens).

    Raises:
        AdvantageError: ``accepted`` not a 1-D bool tensor, ``n < 1``, or a length not divisible
            by ``n``.
    """
    if isinstance(n_samples_per_prompt, bool) or not isinstance(n_samples_per_prompt, int) \
            or n_samples_per_prompt < 1:
        raise AdvantageError(f"n_samples_per_prompt must be a positive int, got {n_samples_per_prompt!r}")
    if not isinstance(accepted, Tensor) or accepted.numel() % n_samples_per_prompt:
        raise AdvantageError(f"accepted cannot be split into prompt groups of "
                             f"n_samples_per_prompt={n_samples_per_prompt}")
    acc = _check_accepted(accepted, accepted.numel())
    return acc.reshape(-1, n_samples_per_prompt).sum(dim=1) >= 2


STD_EPS = 1e-6
"""What :func:`grpo_advantages` adds to a group's std before dividing (the trainer's value)."""


def grpo_advantages(
    rewards: Tensor,
    n_samples_per_prompt: int,
    normalize_std: bool,
    eps: float = STD_EPS,
    accepted: Tensor | None = None,
) -> Tensor:
    """Group-relative advantage of each sample (one value per sample, not per token).

    Samples are grouped contiguously: ``rewards[g*n : (g+1)*n]`` is prompt group ``g``.
    ``A_i = r_i - mean_g(r)``, and with ``normalize_std`` ``A_i / (std_g(r) + eps)`` where the
    std is the *population* std (``unbiased=False``, divide by ``n``), so a group of identical
    rewards gets advantage exactly 0 and ``n = 1`` is well defined (advantage 0).

    With ``accepted`` (rejection sampling without refill,
    docs/design/rejection-sampling.md#rejection-sampling), the mean and the std of group ``g`` are
    taken over its accepted samples only (``k_g`` of them, population std dividing by ``k_g``): a
    rejected sample's reward never sets the baseline its group's accepted samples are scored
    against. Rejected samples get advantage 0. A group with ``k_g < 2`` has no baseline
    (:func:`baseline_groups`): all its advantages are 0. A group whose every sample is accepted
    takes the unmasked computation above, so an all-True ``accepted`` gives bit-identical results to
    ``accepted=None``.

    Args:
        rewards: 1-D float tensor [G * n] of scalar rewards (any float dtype; integer and bool
            rewards are read as float32).
        n_samples_per_prompt: group size ``n >= 1``.
        normalize_std: divide by the group std (+ ``eps``).
        eps: added to the std before dividing (``> 0`` when ``normalize_std``).
        accepted: optional bool tensor [G * n], True = the sample is in its group's baseline
            (the trainer passes True for a sample whose RS gate kept at least one loss token).

    Returns:
        tensor [G * n] of advantages, the rewards' float dtype (float32 for non-float rewards).

    Raises:
        AdvantageError: non 1-D rewards, ``n < 1``, a length not divisible by ``n``, a
            non-finite reward (naming the sample index), a non-positive ``eps``, or an
            ``accepted`` that is not a bool tensor of the rewards' length.
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise AdvantageError(f"rewards must be a 1-D tensor, got {type(rewards).__name__} "
                             f"{tuple(rewards.shape) if isinstance(rewards, Tensor) else ''}")
    if isinstance(n_samples_per_prompt, bool) or not isinstance(n_samples_per_prompt, int) \
            or n_samples_per_prompt < 1:
        raise AdvantageError(f"n_samples_per_prompt must be a positive int, got {n_samples_per_prompt!r}")
    if rewards.numel() % n_samples_per_prompt:
        raise AdvantageError(
            f"{rewards.numel()} rewards cannot be split into prompt groups of "
            f"n_samples_per_prompt={n_samples_per_prompt}"
        )
    if normalize_std and not eps > 0:
        raise AdvantageError(f"eps must be > 0 when normalize_std is set, got {eps!r}")
    if accepted is not None:
        _check_accepted(accepted, rewards.numel())
    r = rewards if rewards.is_floating_point() else rewards.float()
    bad = ~torch.isfinite(r)
    if bool(bad.any()):
        idx = torch.nonzero(bad).flatten().tolist()
        raise AdvantageError(f"non-finite reward for samples {idx[:8]}")
    groups = r.reshape(-1, n_samples_per_prompt)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    if accepted is None:
        return adv.reshape(-1)
    acc = accepted.reshape(-1, n_samples_per_prompt)
    weight = acc.to(r.dtype)
    k = weight.sum(dim=1, keepdim=True).clamp(min=1)
    centred = groups - (groups * weight).sum(dim=1, keepdim=True) / k
    masked = centred
    if normalize_std:
        # rejected samples' deviations are multiplied by 0 (finite: rewards were checked)
        masked = centred / (((centred * weight) ** 2).sum(dim=1, keepdim=True) / k).sqrt().add(eps)
    has_baseline = baseline_groups(accepted, n_samples_per_prompt)[:, None]
    zero = torch.zeros((), dtype=r.dtype)
    out = torch.where(acc.all(dim=1, keepdim=True), adv,
                      torch.where(acc & has_baseline, masked, zero))
    return out.reshape(-1)
