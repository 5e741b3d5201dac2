"""RS without refill: a group's baseline comes from the samples the gate accepted
(docs/design/rejection-sampling.md#rejection-sampling).

Each test drives a real in-process TrainerActor (its ``train``) on hand-built samples whose
rollout logprobs are the trainer's own logprobs (ratio exactly 1, accepted) or 2 nats above
them (per-token ratio e^-2, rejected by a ``sequence`` band [0.5, 2]); the other actors are
fakes. The expected weights come from an independent reference: the same step without RS on
the accepted samples alone.
"""
from __future__ import annotations

import numpy as np
import pytest

from replayrl.rollout.sample import Sample
from replayrl.trainer.errors import EmptyStep
from replayrl.trainer.ranks.trainer_actor import TrainerActor
from tests.trainer_on_samples import (
    float_params,
    initial_checkpoint,
    max_diff,
    own_trace_sample,
    restore_torch_threads,  # noqa: F401 (an autouse fixture: pytest finds it here)
    train_on,
    trainer_actor,
)

RESPONSE_LEN = 3
RS = {"rs_mode": "sequence", "rs_lower": 0.5, "rs_upper": 2.0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return initial_checkpoint(tmp_path_factory.mktemp("ckpt"), 2, 1)


def _actor(checkpoint: str, n: int, groups: int, **settings) -> TrainerActor:
    # micro-batch 1: every sample has its own forward, so a step with an extra (rejected)
    # sample accumulates exactly the reference step's per-sample gradients
    return trainer_actor(checkpoint, n, groups, micro_batch_size=1, **settings)


def _samples(actor: TrainerActor, rewards: list[float], rejected: set[int], n: int) -> list[Sample]:
    """Samples ``0..len(rewards)-1`` (groups of ``n``) with the model's own traces; rollout
    logprobs = the trainer's logprobs, +2 nats per token for the ``rejected`` ones."""
    rng = np.random.default_rng(0)
    return [own_trace_sample(actor, i, i // n, rng.integers(0, 40, 4).astype(np.int32),
                             rng.integers(0, 40, RESPONSE_LEN).astype(np.int32), reward,
                             2.0 if i in rejected else 0.0)
            for i, reward in enumerate(rewards)]


# One AdamW step moves a weight by about --lr (3e-4) wherever its gradient is not tiny, so a
# wrong baseline shows as differences of that size. The step and its reference are compared to
# 1e-6, not bitwise: the extra zero gradients of untrained samples change the summation order
# of the clip's total norm in the last bit.
SAME = 1e-6


async def test_rejected_sample_leaves_its_group_without_a_baseline(checkpoint):
    # the input: one group [100, 1], the reward-100 sample rejected. Before the fix the
    # accepted sample trained with advantage 1 - (100 + 1) / 2 = -49.5; now its group has one
    # accepted sample, no baseline, nothing to train: the step is skipped, nothing moves.
    actor = _actor(checkpoint, n=2, groups=1, **RS)
    samples = _samples(actor, [100.0, 1.0], rejected={0}, n=2)
    before = await actor.weights_digest()
    metrics, reported = await train_on(actor, samples)
    assert metrics["rs_sample_accept_rate"] == 0.5  # the gate did reject exactly sample 0
    assert (metrics["skipped"], metrics["skip_reason"]) == (1, "no_group_baseline")
    assert metrics["rs_degenerate_groups"] == 1 and metrics["trained_groups"] == 0
    assert metrics["loss_tokens"] == 6 and metrics["accepted_tokens"] == 0
    assert "grad_norm" not in metrics
    assert await actor.weights_digest() == before and actor.version == 0 and reported == []


async def test_stop_on_empty_step_raises_and_applies_nothing(checkpoint):
    actor = _actor(checkpoint, n=2, groups=1, stop_on_empty_step=True, **RS)
    samples = _samples(actor, [100.0, 1.0], rejected={0}, n=2)
    before = await actor.weights_digest()
    with pytest.raises(EmptyStep, match="no_group_baseline"):
        await train_on(actor, samples)
    assert await actor.weights_digest() == before and actor.version == 0


async def test_baseline_is_the_mean_of_the_accepted_rewards(checkpoint):
    # group [100, 1, 4] with sample 0 rejected: baseline (1 + 4) / 2 = 2.5, advantages -1.5 and
    # +1.5 -- exactly the RS-off step on the group [1, 4] alone (accepted_tokens denominator:
    # 6 accepted tokens in both). Before the fix the baseline was 35 and both were pushed down.
    actor = _actor(checkpoint, n=3, groups=1, rs_denominator="accepted_tokens", **RS)
    samples = _samples(actor, [100.0, 1.0, 4.0], rejected={0}, n=3)
    before = await actor.weights_digest()
    metrics, reported = await train_on(actor, samples)
    reference = _actor(checkpoint, n=2, groups=1)
    want, _ = await train_on(reference, samples[1:])
    assert metrics["skipped"] == 0 and metrics["rs_degenerate_groups"] == 0 and reported == [1]
    assert metrics["loss_tokens"] == 9 and metrics["accepted_tokens"] == 6 == want["accepted_tokens"]
    got = float_params(await actor.weights_digest())
    assert max_diff(got, float_params(before)) > 1e-4  # the step trained
    assert max_diff(got, float_params(await reference.weights_digest())) < SAME


async def test_degenerate_group_contributes_nothing_next_to_a_trained_one(checkpoint):
    # groups [100, 1] (sample 0 rejected: degenerate) and [3, 1] (whole): the step equals the
    # RS-off step on [3, 1] alone; the degenerate group is counted, its tokens are not trained
    actor = _actor(checkpoint, n=2, groups=2, rs_denominator="accepted_tokens", **RS)
    samples = _samples(actor, [100.0, 1.0, 3.0, 1.0], rejected={0}, n=2)
    metrics, _ = await train_on(actor, samples)
    reference = _actor(checkpoint, n=2, groups=1)
    await train_on(reference, samples[2:])
    assert metrics["rs_degenerate_groups"] == 1 and metrics["trained_groups"] == 1
    assert metrics["accepted_tokens"] == 6  # group [3, 1] only; sample 1's tokens are not trained
    assert max_diff(float_params(await actor.weights_digest()),
                     float_params(await reference.weights_digest())) < SAME


async def test_token_gate_keeps_a_partly_accepted_sample_in_the_baseline(checkpoint):
    # token mode: sample 0 has its first token rejected (ratio e^-2) and two kept; it still
    # trains on those two with advantage r_0 - mean(r_0, r_1), so it is in the baseline: the
    # group is not degenerate and the step trains on 3 + 2 = 5 tokens.
    actor = _actor(checkpoint, n=2, groups=1, rs_mode="token", rs_lower=0.5, rs_upper=2.0)
    samples = _samples(actor, [1.0, 0.0], rejected=set(), n=2)
    lp = samples[0].rollout_logprobs.copy()
    lp[0] += 2.0
    samples[0] = Sample(**{**samples[0].__dict__, "rollout_logprobs": lp})
    metrics, reported = await train_on(actor, samples)
    assert metrics["skipped"] == 0 and metrics["rs_degenerate_groups"] == 0
    assert metrics["accepted_tokens"] == 5 and reported == [1]
