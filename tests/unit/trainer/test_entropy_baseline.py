"""The entropy bonus's baseline (``--entropy-baseline``, trainer/loss/entropy_baseline.py): the
step's mean surprisal against a hand computation, and the trainer folding ``beta * S`` into
every sample's advantage, with ``S`` computed here from the samples' own rollout logprobs.

The trainer tests drive a real in-process TrainerActor with a fake manager and clock
(tests/trainer_on_samples.py).
"""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from replayrl.trainer.loss.entropy_baseline import mean_surprisal
from tests.trainer_on_samples import (
    initial_checkpoint,
    restore_torch_threads,  # noqa: F401 (an autouse fixture: pytest finds it here)
    train_on,
    trainer_actor,
    two_groups_of_two,
)


def test_mean_over_the_selected_tokens_only():
    # the NaN sits where a synthetic EOS's placeholder would: outside the mask, never read
    logprobs = [np.array([-1.0, -2.0, np.nan], np.float32), np.array([-0.5], np.float32),
                np.array([-3.0, -0.25])]
    masks = [np.array([True, True, False]), np.array([False]), np.array([True, False])]
    assert mean_surprisal(logprobs, masks) == pytest.approx((1.0 + 2.0 + 3.0) / 3)


def test_no_selected_token_gives_zero():
    assert mean_surprisal([np.array([-1.0])], [np.array([False])]) == 0.0
    assert mean_surprisal([], []) == 0.0


def test_mismatched_inputs_name_the_sample():
    with pytest.raises(ValueError, match="sample 1"):
        mean_surprisal([np.zeros(2), np.zeros(3)], [np.ones(2, bool), np.ones(2, bool)])
    with pytest.raises(ValueError, match="2 logprob arrays against 1 masks"):
        mean_surprisal([np.zeros(2), np.zeros(3)], [np.ones(2, bool)])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return initial_checkpoint(tmp_path_factory.mktemp("ckpt"), 2, 2)


def _advantages_sent(actor) -> list[torch.Tensor]:
    """Wrap the actor's rank update to record the per-sample advantages it is given."""
    seen, update = [], actor.local.update

    def spy(samples, advantages, *args, **kwargs):
        seen.append(advantages.clone())
        return update(samples, advantages, *args, **kwargs)

    actor.local.update = spy
    return seen


@pytest.mark.parametrize("settings, beta", [({"entropy_coef": 0.3, "entropy_baseline": True}, 0.3),
                                            ({"entropy_coef": 0.3}, 0.0),  # opt-in: off by default
                                            ({"entropy_coef": 0.0, "entropy_baseline": True}, 0.0)])
def test_the_trainer_subtracts_beta_times_the_mean_surprisal(checkpoint, settings, beta):
    actor = trainer_actor(checkpoint, 2, 2, micro_batch_size=2, **settings)
    samples = two_groups_of_two(actor, 4, 3)
    # sample 3's last token is a synthetic EOS, not the engine's: its logprob is left out of S
    samples[3] = dataclasses.replace(samples[3], synthetic_eos=True)
    seen = _advantages_sent(actor)
    metrics, _ = asyncio.run(train_on(actor, samples))
    picked = np.concatenate([s.rollout_logprobs[:2] if i == 3 else s.rollout_logprobs
                             for i, s in enumerate(samples)])
    surprisal = -float(picked.astype(np.float64).mean())
    assert surprisal > 0.5  # a random policy over the embedded vocabulary: far from 0
    # rewards 0 / 1 in each group of two: GRPO advantages -0.5 / +0.5
    expected = np.array([-0.5, 0.5, -0.5, 0.5]) - beta * surprisal
    np.testing.assert_allclose(seen[0].numpy(), expected, rtol=0, atol=1e-5)
    if beta:
        assert metrics["entropy_baseline"] == pytest.approx(surprisal, abs=1e-5)
    else:
        assert "entropy_baseline" not in metrics


def test_rejected_tokens_groups_without_a_baseline_and_observations_are_left_out(checkpoint):
    # the RS token gate rejects sample 0's middle token (behaviour ratio e^5) and all of sample
    # 2, so group 1 has one sample left and no baseline: S is over sample 0's tokens 0 and 2
    # and all of sample 1
    actor = trainer_actor(checkpoint, 2, 2, micro_batch_size=2, entropy_coef=0.3,
                          entropy_baseline=True, rs_mode="token", rs_lower=0.5, rs_upper=2.0)
    samples = two_groups_of_two(actor, 4, 3)
    shifted = samples[0].rollout_logprobs.copy()
    shifted[1] -= 5.0
    samples[0] = dataclasses.replace(samples[0], rollout_logprobs=shifted)
    samples[2] = dataclasses.replace(samples[2], rollout_logprobs=samples[2].rollout_logprobs - 5.0)
    metrics, _ = asyncio.run(train_on(actor, samples))
    assert metrics["rs_degenerate_groups"] == 1
    picked = np.concatenate([samples[0].rollout_logprobs[[0, 2]], samples[1].rollout_logprobs])
    assert metrics["entropy_baseline"] == pytest.approx(-float(picked.astype(np.float64).mean()), abs=1e-5)

    # an observation token (loss mask 0) is no sampled loss token: its logprob is left out
    actor = trainer_actor(checkpoint, 2, 2, micro_batch_size=2, entropy_coef=0.3, entropy_baseline=True)
    samples = two_groups_of_two(actor, 4, 3)
    mask, logprobs = samples[1].loss_mask.copy(), samples[1].rollout_logprobs.copy()
    mask[1], logprobs[1] = 0, 0.0
    samples[1] = dataclasses.replace(samples[1], loss_mask=mask, rollout_logprobs=logprobs)
    metrics, _ = asyncio.run(train_on(actor, samples))
    picked = np.concatenate([samples[0].rollout_logprobs, samples[1].rollout_logprobs[[0, 2]],
                             samples[2].rollout_logprobs, samples[3].rollout_logprobs])
    assert metrics["entropy_baseline"] == pytest.approx(-float(picked.astype(np.float64).mean()), abs=1e-5)
