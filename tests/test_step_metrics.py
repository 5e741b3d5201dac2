"""The one metrics row of a step (tools/train_loop.py:step_metrics), used by train and the REPL."""
from __future__ import annotations

import pytest

from tools.train_loop import step_metrics


def test_row_merges_summary_training_and_push_and_drops_policy_versions():
    summary = {"reward_mean": 0.25, "policy_versions": [0, 0], "staleness_max": 1}
    trained = {"trainer_version": 3, "loss_tokens": 12}
    push = {"seconds": 0.5, "bytes": 1024, "version": 3}
    assert step_metrics(7, summary, trained, push, 2.0) == {
        "step": 7, "reward_mean": 0.25, "staleness_max": 1, "trainer_version": 3,
        "loss_tokens": 12, "weight_push_seconds": 0.5, "weight_push_bytes": 1024,
        "step_seconds": 2.0}


def test_push_without_its_figures_is_a_key_error():
    with pytest.raises(KeyError):
        step_metrics(0, {}, {}, {"seconds": 1.0}, 0.0)
