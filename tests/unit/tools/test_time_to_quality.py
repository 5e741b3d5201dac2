"""Time to quality (tools/bench/time_to_quality.py), every figure worked out by hand."""
from __future__ import annotations

import pytest

from replayrl.tools.bench import time_to_quality as ttq


def test_threshold_is_the_share_of_the_reference_final_window():
    # last 2 of [0.1, 0.5, 0.7, 0.9]: mean 0.8, x 0.9 = 0.72
    assert ttq.quality_threshold([0.1, 0.5, 0.7, 0.9], window=2) == pytest.approx(0.72)
    # fewer steps than the window: all of them, (0.2 + 0.4) / 2 * 0.5 = 0.15
    assert ttq.quality_threshold([0.2, 0.4], window=10, share=0.5) == pytest.approx(0.15)
    with pytest.raises(ValueError):
        ttq.quality_threshold([], window=2)
    with pytest.raises(ValueError):
        ttq.quality_threshold([0.5], window=2, share=0.0)


def test_reward_curve_and_reward_after():
    rewards, seconds = [0.0, 0.2, 0.4, 0.6], [1.0, 2.0, 3.0, 4.0]
    times, means = ttq.reward_curve(rewards, seconds, window=2)
    assert times == pytest.approx([1.0, 3.0, 6.0, 10.0])
    assert means == pytest.approx([0.0, 0.1, 0.3, 0.5])
    # by 6 s three steps had finished: mean of steps 2-3 = 0.3; by 5.9 s only two
    assert ttq.reward_after(rewards, seconds, 6.0, window=2) == pytest.approx(0.3)
    assert ttq.reward_after(rewards, seconds, 5.9, window=2) == pytest.approx(0.1)
    assert ttq.reward_after(rewards, seconds, 0.5, window=2) is None
    with pytest.raises(ValueError):
        ttq.reward_curve(rewards, seconds[:-1], window=2)


def test_time_to_quality_of_two_runs():
    # reference (theirs): last 2 steps 0.8, 1.0 -> threshold 0.81
    theirs_r, theirs_s = [0.2, 0.6, 0.8, 1.0], [2.0, 2.0, 2.0, 2.0]
    ours_r, ours_s = [0.5, 0.9, 0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0, 1.0]
    q = ttq.time_to_quality(ours_r, ours_s, theirs_r, theirs_s, window=2)
    assert q.threshold == pytest.approx(0.81)
    assert q.seconds_ours == pytest.approx(3.0)     # steps 2-3 mean 0.9 first, after 3 x 1 s
    assert q.seconds_theirs == pytest.approx(8.0)   # steps 3-4 mean 0.9, after 4 x 2 s
    assert q.seconds_ratio == pytest.approx(3.0 / 8.0)
    assert q.equal_seconds == pytest.approx(5.0)    # ours ran 5 s, theirs 8 s
    assert q.reward_ours == pytest.approx(0.9)
    assert q.reward_theirs == pytest.approx(0.4)    # two steps done by 5 s: (0.2 + 0.6) / 2
    never = ttq.time_to_quality([0.0, 0.0], [1.0, 1.0], theirs_r, theirs_s, window=2)
    assert never.seconds_ours is None and never.seconds_ratio is None


def test_seconds_to_threshold_counts_the_first_full_window():
    assert ttq.seconds_to_threshold([0.0, 1.0, 1.0], [1.0, 2.0, 3.0], 1.0, window=2) == pytest.approx(6.0)
    assert ttq.seconds_to_threshold([1.0], [1.0], 0.5, window=2) is None


def test_reward_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = ttq.plot_reward_curves([("1m x 2", {"replayrl": ([0.1, 0.5], [1.0, 1.0]),
                                               "TRL": ([0.1, 0.3], [2.0, 2.0])}, 0.27)],
                                  tmp_path / "reward.png")
    assert path.stat().st_size > 1000
