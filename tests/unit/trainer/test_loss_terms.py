"""The pieces of the policy loss on their own: TIS weights and the two clipped-surrogate terms,
against values worked out by hand."""
from __future__ import annotations

import math

import torch

from replayrl.trainer.loss.losses import clipped_terms, tis_weights


def test_tis_weight_is_the_capped_ratio_and_one_where_nothing_was_sampled():
    prox = torch.tensor([0.0, -1.0, -2.0, -0.5], dtype=torch.float64)
    roll = torch.tensor([-1.0, -1.0, 0.0, -0.1], dtype=torch.float64)
    sampled = torch.tensor([True, True, False, True])
    w = tis_weights(prox, roll, sampled, 2.0)
    # exp(1) = 2.718 capped at 2; exp(0) = 1; not sampled: 1; exp(-0.4) below the cap
    expected = torch.tensor([2.0, 1.0, 1.0, math.exp(-0.4)], dtype=torch.float64)
    assert w.dtype == torch.float64 and torch.allclose(w, expected, rtol=0, atol=1e-15)
    assert torch.equal(tis_weights(prox, roll, sampled, None), torch.ones(4, dtype=torch.float64))


def test_clipped_terms_clip_the_ratio_to_the_asymmetric_range():
    ratio = torch.tensor([0.5, 1.0, 1.5, 1.1])
    adv = torch.tensor([1.0, -2.0, 3.0, -1.0])
    unclipped, clipped = clipped_terms(ratio, adv, 0.2, 0.28)
    assert torch.allclose(unclipped, torch.tensor([0.5, -2.0, 4.5, -1.1]))
    # ratio clamped to [0.8, 1.28]: 0.8 * 1, 1.0 * -2, 1.28 * 3, 1.1 * -1
    assert torch.allclose(clipped, torch.tensor([0.8, -2.0, 3.84, -1.1]))
    # the clip is active (gradient zeroed) only where the clipped term is the smaller one
    assert (clipped < unclipped).tolist() == [False, False, True, False]
