"""The one metrics row of a step (tools/run/train_loop.py:step_metrics), used by train and the REPL."""
from __future__ import annotations

import pytest

from replayrl.tools.run.train_loop import step_metrics


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


def test_skipped_row_is_written_logged_and_shown_without_update_figures(tmp_path, caplog):
    import json
    import logging

    from replayrl.tools.run.metrics import MetricsRecorder, progress_status

    # a skipped step has no grad_norm / train_rollout_logprob_abs_diff / ...: nothing may fail
    row = {"step": 3, "reward_mean": 0.5, "skipped": 1, "skip_reason": "no_accepted_tokens",
           "trainer_version": 2, "staleness_mean": 0.0, "step_seconds": 1.25}
    assert progress_status(row) == ("skipped (no_accepted_tokens)  reward 0.500  |Δlogp| n/a  "
                                    "stale 0.0  flips n/a/n/a  1.25s/step")
    with caplog.at_level(logging.WARNING, logger="replayrl"):
        with MetricsRecorder(tmp_path, num_steps=1, show_progress=False) as recorder:
            recorder.record(row)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == row
    assert "step 3 skipped (no_accepted_tokens)" in caplog.text and "version 2" in caplog.text
    assert "1 steps (1 skipped)" in recorder.summary()


def test_summary_shows_the_steps_seconds_and_the_run_with_its_start_up(tmp_path):
    from replayrl.tools.run.metrics import MetricsRecorder

    with MetricsRecorder(tmp_path, num_steps=3, show_progress=False) as recorder:
        for step, seconds in enumerate((0.125, 0.125, 0.15)):  # 0.4 s of steps in all
            recorder.record({"step": step, "reward_mean": 0.5, "step_seconds": seconds})
    # a 3-step run waits 33 s for its actors: "in 0s" alone read as if the command took none
    assert recorder.summary(33.4).startswith("replayrl: 3 steps in 0.4 s (33 s with start-up)  ")
    assert recorder.summary().startswith("replayrl: 3 steps in 0.4 s  reward")
    assert recorder.summary(9.96).startswith("replayrl: 3 steps in 0.4 s (10 s with start-up)")


def test_summary_averages_the_traces_bytes_per_token_over_the_steps_that_have_them(tmp_path):
    from replayrl.tools.run.metrics import MetricsRecorder

    with MetricsRecorder(tmp_path, num_steps=3, show_progress=False) as recorder:
        for step, wire in enumerate((10.0, None, 20.6)):  # a step without the figure: left out
            recorder.record({"step": step, "reward_mean": 0.5, "step_seconds": 0.1,
                             "trace_bytes_per_token": wire})
    assert "  trace B/token=15.3  " in recorder.summary()  # (10 + 20.6) / 2


async def test_nothing_is_pushed_after_a_skipped_step():
    from replayrl.tools.run.train_loop import NO_PUSH, push_after
    from tests.fakes import FakeProxy

    pushed = []

    async def push_weights(wait):
        pushed.append(1)
        return {"version": 1, "seconds": 0.5, "bytes": 10}

    trainer = FakeProxy(push_weights=push_weights)
    assert await push_after({"skipped": 1}, trainer) == NO_PUSH and pushed == []
    assert await push_after({"skipped": 0}, trainer) == {"version": 1, "seconds": 0.5, "bytes": 10}
    assert pushed == [1]
