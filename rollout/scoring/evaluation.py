"""Evaluation figures of one prompt set: mean reward and pass@k.

A sample *passes* when its reward is at least 1.0, the full reward of every built-in verifier
(``exact`` / ``math`` give 0 or 1; ``digits`` gives 1 only to the exact, stopped answer).
pass@k is the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models
Trained on Code" (HumanEval): with ``n`` samples of a prompt of which ``c`` pass,
``pass@k = 1 - C(n - c, k) / C(n, k)``, averaged over prompts.
"""
from __future__ import annotations

from math import comb

import numpy as np

__all__ = ["PASS_REWARD", "pass_at_k", "eval_metrics"]

PASS_REWARD = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` of ``n`` samples, ``c`` of them passing, passes.

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def eval_metrics(name: str, rewards: np.ndarray) -> dict[str, float]:
    """The metrics of set ``name`` from its rewards, float ``[prompts, n]``.

    Returns:
        ``{"eval/NAME/reward_mean", "eval/NAME/pass@1", "eval/NAME/pass@n" (when n > 1)}``.

    Raises:
        ValueError: ``rewards`` is not a non-empty 2-d array.
    """
    if rewards.ndim != 2 or rewards.size == 0:
        raise ValueError(f"eval set {name}: rewards must be [prompts, n], got shape {rewards.shape}")
    n = rewards.shape[1]
    passed = (rewards >= PASS_REWARD).sum(axis=1)
    out = {f"eval/{name}/reward_mean": float(rewards.mean())}
    for k in sorted({1, n}):
        out[f"eval/{name}/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in passed]))
    return out
