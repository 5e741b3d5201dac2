"""The entropy coefficient per step: adaptive entropy control (``--entropy-target``) and the
linear warmup (``--entropy-coef-warmup-steps``), their coefficients computed by hand, the bonus
reaching the loss exactly as a fixed ``--entropy-coef`` of the same value does, and the state
surviving a checkpoint.

The trainer tests drive a real in-process TrainerActor with a fake manager and clock
(tests/trainer_on_samples.py); the reference for "the bonus reached the loss" is the
fixed-coefficient path, which tests/unit/trainer/test_entropy_bonus.py holds against a hand
computation.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from replayrl.trainer.errors import TrainerConfigError
from replayrl.trainer.loss.entropy_control import EntropyControl
from tests.trainer_on_samples import (
    float_params,
    initial_checkpoint,
    max_diff,
    restore_torch_threads,  # noqa: F401 (an autouse fixture: pytest finds it here)
    train_on,
    trainer_actor,
    two_groups_of_two,
)


def test_fixed_coefficient_without_a_target():
    control = EntropyControl(ceiling=0.05)
    for entropy in (3.0, 0.01, None):
        control.observe(entropy)
        assert control.bonus == 0.05


def test_the_coefficient_walks_by_its_step_within_zero_and_the_ceiling():
    control = EntropyControl(ceiling=0.03, target=0.5, step=0.01)
    assert control.bonus == 0.0  # nothing measured yet
    # entropy per step, then the bonus of the next step, worked out by hand:
    # above: 0 - 0.01 -> 0 (floor); below x4: 0.01, 0.02, 0.03, 0.03 (ceiling);
    # above: 0.02 but no bonus; below: 0.03; unmeasured (skipped step): unchanged
    walk = [(1.0, 0.0), (0.4, 0.01), (0.4, 0.02), (0.4, 0.03), (0.4, 0.03), (0.6, 0.0),
            (0.3, 0.03), (None, 0.03), (float("nan"), 0.03)]
    for entropy, bonus in walk:
        control.observe(entropy)
        assert control.bonus == pytest.approx(bonus, abs=1e-12), entropy


def test_the_warmup_ramps_the_fixed_coefficient_over_trained_steps():
    control = EntropyControl(ceiling=0.05, warmup=4)
    # the k-th trained step (from policy version k - 1) has 0.05 x k / 4, by hand; a skipped
    # step leaves the version, so it does not count
    seen = [control.at(version) for version in (0, 1, 1, 2, 3, 4)]
    assert seen == pytest.approx([0.0125, 0.025, 0.025, 0.0375, 0.05, 0.05], abs=1e-12)
    assert EntropyControl(ceiling=0.05).at(0) == 0.05  # no warmup: the whole bonus at once


def test_the_warmup_scales_the_adaptive_coefficient():
    control = EntropyControl(ceiling=0.04, target=0.5, step=0.02, warmup=4)
    # below the target every step: the walk gives 0.02, 0.04, 0.04; the ramp 2/4, 3/4, 4/4
    seen = []
    for version in (1, 2, 3):
        control.observe(0.1)
        seen.append(control.at(version))
    assert seen == pytest.approx([0.01, 0.03, 0.04], abs=1e-12)


def test_state_round_trip():
    control = EntropyControl(ceiling=0.1, target=1.0, step=0.02)
    for _ in range(3):
        control.observe(0.5)
    fresh = EntropyControl(ceiling=0.1, target=1.0, step=0.02)
    fresh.load_state_dict(control.state_dict())
    assert (fresh.coef, fresh.below, fresh.bonus) == (control.coef, True, pytest.approx(0.06))


@pytest.mark.parametrize("field, value", [("ceiling", -0.1), ("target", float("inf")),
                                          ("step", 0.0), ("step", float("nan")), ("warmup", -1)])
def test_bad_settings_are_refused(field, value):
    settings = {"ceiling": 0.05, "target": 0.5, "step": 0.01, field: value}
    with pytest.raises(TrainerConfigError, match=field):
        EntropyControl(**settings)


def test_a_target_without_a_ceiling_is_refused_before_any_process_starts():
    from replayrl.trainer.config import TrainerConfig

    with pytest.raises(TrainerConfigError, match="--entropy-target needs --entropy-coef > 0"):
        TrainerConfig(entropy_target=0.5, entropy_coef=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return initial_checkpoint(tmp_path_factory.mktemp("ckpt"), 2, 2)


def _actor(checkpoint: str, **settings):
    return trainer_actor(checkpoint, 2, 2, micro_batch_size=2, **settings)


def test_the_bonus_reaches_the_loss_and_survives_a_checkpoint(checkpoint, tmp_path):
    # a target far above any entropy: step 1 trains without a bonus (nothing measured yet),
    # step 2 with the coefficient one step up
    adaptive = dict(entropy_target=50.0, entropy_coef_step=0.4, entropy_coef=0.4)
    run = _actor(checkpoint, **adaptive)
    plain = _actor(checkpoint, entropy_coef=0.0)
    samples = two_groups_of_two(run, 4, 3)
    first, _ = asyncio.run(train_on(run, samples))
    asyncio.run(train_on(plain, samples))
    assert first["entropy_coef"] == 0.0 and 0.0 < first["surprisal_mean"] < 50.0
    assert max_diff(float_params(run.backend.digest()), float_params(plain.backend.digest())) == 0.0
    asyncio.run(run.save_checkpoint(str(tmp_path / "adaptive")))
    asyncio.run(plain.save_checkpoint(str(tmp_path / "plain")))

    second, _ = asyncio.run(train_on(run, samples))
    assert second["entropy_coef"] == pytest.approx(0.4)
    # the reference: a fixed coefficient of 0.4 from the same weights and optimizer state
    fixed = _actor(checkpoint, entropy_coef=0.4)
    asyncio.run(fixed.load_checkpoint(str(tmp_path / "plain")))
    asyncio.run(train_on(fixed, samples))
    after = float_params(run.backend.digest())
    assert max_diff(after, float_params(fixed.backend.digest())) == 0.0
    assert max_diff(after, float_params(plain.backend.digest())) > 0.0  # the bonus moved them

    resumed = _actor(checkpoint, **adaptive)
    asyncio.run(resumed.load_checkpoint(str(tmp_path / "adaptive")))
    assert resumed.entropy.bonus == pytest.approx(0.4)
    again, _ = asyncio.run(train_on(resumed, samples))
    assert again["entropy_coef"] == second["entropy_coef"]
    np.testing.assert_array_equal(
        np.concatenate(list(float_params(resumed.backend.digest()).values())),
        np.concatenate(list(after.values())))


def test_the_warmup_reaches_the_loss_and_survives_a_checkpoint(checkpoint, tmp_path):
    # --entropy-coef 0.4 over 2 steps: step 1 trains as a fixed 0.2 does, bit for bit; a
    # checkpoint after it resumes at the full 0.4, not at the ramp's start
    warm = _actor(checkpoint, entropy_coef=0.4, entropy_coef_warmup_steps=2)
    half = _actor(checkpoint, entropy_coef=0.2)
    samples = two_groups_of_two(warm, 4, 3)
    first, _ = asyncio.run(train_on(warm, samples))
    asyncio.run(train_on(half, samples))
    assert first["entropy_coef"] == pytest.approx(0.2) and warm.version == 1
    assert max_diff(float_params(warm.backend.digest()), float_params(half.backend.digest())) == 0.0
    asyncio.run(warm.save_checkpoint(str(tmp_path / "warm")))

    resumed = _actor(checkpoint, entropy_coef=0.4, entropy_coef_warmup_steps=2)
    asyncio.run(resumed.load_checkpoint(str(tmp_path / "warm")))
    assert resumed.version == 1 and resumed.entropy.at(resumed.version) == pytest.approx(0.4)
    second, _ = asyncio.run(train_on(resumed, samples))
    assert second["entropy_coef"] == pytest.approx(0.4)
