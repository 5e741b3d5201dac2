"""GRPO advantages: each sample's reward relative to its prompt group.

Source: Shao et al. 2024, "DeepSeekMath" (GRPO, outcome supervision): the advantage of every
token of sample ``i`` in a group is ``(r_i - mean(r_group)) / std(r_group)``; the division by the
group standard deviation is optional here (Liu et al. 2025, "Dr. GRPO", argue for leaving it out).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["AdvantageError", "grpo_advantages"]


class AdvantageError(ValueError):
    """Bad input to an advantage estimator (shape, group size, non-finite reward)."""


def grpo_advantages(
    rewards: Tensor,
    n_samples_per_prompt: int,
    normalize_std: bool,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantage of each sample (one value per sample, not per token).

    Samples are grouped contiguously: ``rewards[g*n : (g+1)*n]`` is prompt group ``g``.
    ``A_i = r_i - mean_g(r)``, and with ``normalize_std`` ``A_i / (std_g(r) + eps)`` where the
    std is the *population* std (``unbiased=False``, divide by ``n``), so a group of identical
    rewards gets advantage exactly 0 and ``n = 1`` is well defined (advantage 0).

    Args:
        rewards: 1-D float tensor [G * n] of scalar rewards (any float dtype; integer and bool
            rewards are read as float32).
        n_samples_per_prompt: group size ``n >= 1``.
        normalize_std: divide by the group std (+ ``eps``).
        eps: added to the std before dividing (``> 0`` when ``normalize_std``).

    Returns:
        tensor [G * n] of advantages, the rewards' float dtype (float32 for non-float rewards).

    Raises:
        AdvantageError: non 1-D rewards, ``n < 1``, a length not divisible by ``n``, a
            non-finite reward (naming the sample index) or a non-positive ``eps``.
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
    r = rewards if rewards.is_floating_point() else rewards.float()
    bad = ~torch.isfinite(r)
    if bool(bad.any()):
        idx = torch.nonzero(bad).flatten().tolist()
        raise AdvantageError(f"non-finite reward for samples {idx[:8]}")
    groups = r.reshape(-1, n_samples_per_prompt)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.reshape(-1)
