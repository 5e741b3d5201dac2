"""GRPO advantages against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.advantages import AdvantageError, grpo_advantages


def test_group_mean_subtracted_per_contiguous_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    got = grpo_advantages(rewards, 3, normalize_std=False)
    # group 0 mean 1/3, group 1 mean 2
    want = [2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0]
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_std_normalisation_uses_population_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    got = grpo_advantages(rewards, 4, normalize_std=True, eps=1e-6)
    # mean 0.25, population std sqrt(0.1875) (the unbiased std would be 0.5)
    std = math.sqrt(((0.75) ** 2 + 3 * 0.25**2) / 4)
    want = [0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3
    assert got.tolist() == pytest.approx(want, rel=1e-12)


def test_identical_rewards_and_singleton_groups_give_zero():
    assert grpo_advantages(torch.tensor([1.0, 1.0, 0.5, 0.5]), 2, normalize_std=True).tolist() == [0.0] * 4
    assert grpo_advantages(torch.tensor([3.0, -1.0]), 1, normalize_std=True).tolist() == [0.0, 0.0]


def test_integer_rewards_become_float32():
    got = grpo_advantages(torch.tensor([1, 0]), 2, normalize_std=False)
    assert got.dtype == torch.float32 and got.tolist() == [0.5, -0.5]


@pytest.mark.parametrize(
    "rewards, n, pattern",
    [
        (torch.zeros(5), 2, "cannot be split"),
        (torch.zeros(4), 0, "positive int"),
        (torch.zeros(2, 2), 2, "1-D"),
        (torch.tensor([0.0, float("nan")]), 2, r"samples \[1\]"),
    ],
)
def test_bad_input_raises(rewards, n, pattern):
    with pytest.raises(AdvantageError, match=pattern):
        grpo_advantages(rewards, n, normalize_std=False)
