"""Entropy beside the reward: the summary line's entropy figure and the one-line collapse warning
(tools/run/metrics.py, docs/design/trainer-math.md#entropy-collapse)."""
from __future__ import annotations

import logging

from replayrl.tools.run.metrics import CollapseWatch, MetricsRecorder


def rows(rewards, entropies, reward_max=1.0):
    return [{"step": i, "reward_mean": r, "reward_max": reward_max, "support_entropy_mean": h,
             "step_seconds": 0.5} for i, (r, h) in enumerate(zip(rewards, entropies))]


def test_collapse_below_the_best_reward_is_said_once_on_the_first_step_that_shows_it():
    watch = CollapseWatch(floor=0.05, window=4, margin=0.05)
    # entropy 1.0, 0.5, then 0.01 from step 2: the 4-step mean is below 0.05 first at step 5
    # ((0.01 * 4) / 4 = 0.01; at step 4 it is (0.5 + 0.03) / 4 = 0.1325)
    said = [watch.see(r) for r in rows([0.5] * 10, [1.0, 0.5] + [0.01] * 8)]
    assert [i for i, s in enumerate(said) if s] == [5]
    assert "step 5" in said[5] and "0.010 < 0.05" in said[5] and "best 1.000" in said[5]


def test_no_warning_when_the_reward_is_at_its_best_or_the_entropy_stays_up():
    converged = CollapseWatch(window=4)  # deterministic at the best reward: nothing to say
    assert not any(converged.see(r) for r in rows([0.98] * 10, [0.0] * 10, reward_max=1.0))
    exploring = CollapseWatch(window=4)
    assert not any(exploring.see(r) for r in rows([0.5] * 10, [0.2] * 10))
    no_entropy = CollapseWatch(window=1)  # a row without the figure is never a collapse
    assert no_entropy.see({"step": 0, "reward_mean": 0.1}) is None


def test_best_is_the_best_step_mean_when_rows_lack_reward_max():
    watch = CollapseWatch(floor=0.05, window=2, margin=0.05)
    seq = [{"step": i, "reward_mean": r, "support_entropy_mean": 0.0}
           for i, r in enumerate([0.9, 0.9, 0.5, 0.5])]
    said = [watch.see(r) for r in seq]
    # step 2: mean reward (0.9 + 0.5) / 2 = 0.7 < 0.9 - 0.05
    assert [i for i, s in enumerate(said) if s] == [2]


def test_summary_shows_last_tenth_entropy_and_recorder_warns_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="replayrl"):
        with MetricsRecorder(tmp_path, num_steps=40, show_progress=False) as recorder:
            for row in rows([0.5] * 40, [1.0] * 10 + [0.0] * 30):
                recorder.record(row)
    assert caplog.text.count("entropy collapse") == 1
    # last 10 % of 40 steps = 4 steps of entropy 0.0; first / last reward 0.5
    assert "reward first10%=0.500 last10%=0.500 ratio=1.0x  entropy last10%=0.000" in recorder.summary()


def test_summary_says_na_without_entropy(tmp_path):
    with MetricsRecorder(tmp_path, num_steps=1, show_progress=False) as recorder:
        recorder.record({"step": 0, "reward_mean": 0.2, "step_seconds": 1.0})
    assert "entropy last10%=n/a" in recorder.summary()
