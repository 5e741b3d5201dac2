"""GRPO advantages against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from replayrl.trainer.errors import AdvantageError
from replayrl.trainer.loss.advantages import baseline_groups, grpo_advantages


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


# ---- baseline over the samples RS accepted (refill off) ---------------------------------


def test_rejected_reward_does_not_set_the_baseline():
    # a rejected sample's reward sets no baseline (docs/design/rejection-sampling.md#rejection-sampling):
    # group [100, 1], the reward-100 sample rejected. One accepted sample is no baseline: both
    # advantages 0 (a baseline over both would give the accepted one 1 - 50.5 = -49.5).
    got = grpo_advantages(torch.tensor([100.0, 1.0]), 2, normalize_std=False,
                          accepted=torch.tensor([False, True]))
    assert got.tolist() == [0.0, 0.0]
    assert baseline_groups(torch.tensor([False, True]), 2).tolist() == [False]


def test_baseline_and_std_over_accepted_samples_only():
    rewards = torch.tensor([100.0, 1.0, 4.0, 2.0, 2.0, 5.0], dtype=torch.float64)
    accepted = torch.tensor([False, True, True, True, True, True])
    # group 0: mean of {1, 4} = 2.5 -> [0 (rejected), -1.5, 1.5]; group 1 whole: mean 3
    got = grpo_advantages(rewards, 3, normalize_std=False, accepted=accepted)
    assert got.tolist() == [0.0, -1.5, 1.5, -1.0, -1.0, 2.0]
    # population std of {1, 4} is 1.5; of {2, 2, 5} is sqrt((1 + 1 + 4) / 3) = sqrt(2)
    got = grpo_advantages(rewards, 3, normalize_std=True, eps=1e-6, accepted=accepted)
    s = math.sqrt(2.0)
    want = [0.0, -1.5 / (1.5 + 1e-6), 1.5 / (1.5 + 1e-6), -1 / (s + 1e-6), -1 / (s + 1e-6), 2 / (s + 1e-6)]
    assert got.tolist() == pytest.approx(want, rel=1e-12)


def test_groups_with_fewer_than_two_accepted_samples_are_degenerate():
    accepted = torch.tensor([False, False, True, False, True, True])
    assert baseline_groups(accepted, 2).tolist() == [False, False, True]
    got = grpo_advantages(torch.tensor([3.0, 7.0, 1.0, 9.0, 0.0, 1.0]), 2, normalize_std=True,
                          accepted=accepted)
    # last group {0, 1}: mean 0.5, population std 0.5
    assert got.tolist() == [0.0, 0.0, 0.0, 0.0, pytest.approx(-0.5 / (0.5 + 1e-6)),
                            pytest.approx(0.5 / (0.5 + 1e-6))]


@pytest.mark.parametrize("normalize_std", [False, True])
def test_everything_accepted_is_bit_identical_to_no_mask(normalize_std):
    # RS off (the default) and exact refill (whole groups) must not change a bit of the figures
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        rewards = torch.rand(48, generator=g, dtype=dtype) * 10 - 3
        plain = grpo_advantages(rewards, 8, normalize_std=normalize_std)
        masked = grpo_advantages(rewards, 8, normalize_std=normalize_std,
                                 accepted=torch.ones(48, dtype=torch.bool))
        assert torch.equal(plain, masked) and masked.dtype == dtype


@pytest.mark.parametrize("accepted, pattern", [
    (torch.ones(3, dtype=torch.bool), "4 entries"),
    (torch.ones(4), "bool"),
    ([True] * 4, "bool"),
])
def test_bad_accepted_mask_raises(accepted, pattern):
    with pytest.raises(AdvantageError, match=pattern):
        grpo_advantages(torch.zeros(4), 2, normalize_std=False, accepted=accepted)
