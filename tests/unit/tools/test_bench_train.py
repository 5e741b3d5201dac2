"""``replayrl bench train``: the training-table row against values computed by hand."""
from __future__ import annotations

import pytest

from replayrl.tools.bench.train import header, largest_window_fall, long_cells, table_row


def _rows(rewards, gaps, seconds, flips=None):
    rows = [{"reward_mean": r, "train_rollout_logprob_abs_diff": g, "step_seconds": s}
            for r, g, s in zip(rewards, gaps, seconds)]
    for row, f in zip(rows, flips or []):
        row.update(f)
    return rows


def test_row_by_hand():
    # 20 steps: first 10 % = steps 0-1, last 10 % = steps 18-19
    rewards = [0.1, 0.3] + [0.5] * 16 + [0.8, 1.0]
    gaps = [0.01] * 10 + [0.03] * 10  # mean 0.02
    seconds = [0.5] * 20  # 10 s of steps
    flips = [{"routing_flip_rate": 0.0, "indexer_flip_rate": 0.0}] * 19 + [
        {"routing_flip_rate": 0.25, "indexer_flip_rate": 0.0}]
    rows = _rows(rewards, gaps, seconds, flips)
    for i, row in enumerate(rows):  # entropy of the last 10 % (steps 18, 19): (0.1 + 0.3) / 2
        row["support_entropy_mean"] = {18: 0.1, 19: 0.3}.get(i, 2.0)
    row = table_row(2, rows, wall_seconds=31.4)
    assert row == "| 2 | 0.200 | 0.900 | 4.5x | 0.200 | 0.0200 | 0.25 / 0 | 10 | 31 |"


def test_absent_values_are_not_zero():
    rows = _rows([0.0, 0.5], [None, None], [1.0, 1.0])  # no flip keys, no finite gap
    assert table_row(1, rows, 3.0) == "| 1 | 0.000 | 0.500 | n/a | n/a | n/a | n/a / n/a | 2 | 3 |"


def test_no_rows_is_an_error():
    with pytest.raises(ValueError):
        table_row(1, [], 1.0)


def test_largest_window_fall_by_hand():
    # windows of 2: means 0.2, 0.8, 0.5, 0.9, 0.6 -> falls 0.8 - 0.5 = 0.3, 0.9 - 0.6 = 0.3
    # and 0.8 - 0.6 = 0.2; the largest is 0.3; the trailing single step is left out
    rewards = [0.1, 0.3, 0.8, 0.8, 0.4, 0.6, 1.0, 0.8, 0.6, 0.6, 0.0]
    assert largest_window_fall(rewards, window=2) == pytest.approx(0.3)
    assert largest_window_fall([0.1, 0.2, 0.3, 0.4], window=2) == 0.0  # only rising
    assert largest_window_fall([0.5], window=2) == 0.0  # no whole window


def test_long_cells_and_header():
    rows = [{"reward_mean": 1.0 if i < 250 else 0.9, "support_entropy_mean": 0.5}
            for i in range(500)]
    # last 10 % = 50 steps of 0.9; windows 1.0 then 0.9 fall by 0.1
    assert long_cells(rows) == " 0.900 | 0.500 | 0.100 |"
    text = header(3000).splitlines()
    assert text[0].count("|") == text[1].count("|") == 13
    assert "3000 steps: reward, last 10 %" in text[0]
    assert header(0).splitlines()[1] == "|---" * 9 + "|"


def test_default_is_one_default_length_run_per_seed(monkeypatch, capsys):
    # the table of docs/benchmarks.md is one `replayrl train` per seed at its own --num-steps;
    # the 3000-step run is asked for (--long-steps), not paid for by everyone who runs the bench
    from replayrl.tools.bench import train

    calls = []

    def fake_run_seed(seed, output_dir, extra):
        calls.append((seed, list(extra)))
        return _rows([0.5, 0.5], [0.01, 0.01], [1.0, 1.0]), 2.0

    monkeypatch.setattr(train, "run_seed", fake_run_seed)
    assert train.main(["--seeds", "1", "2", "--", "--num-digits", "3"]) == 0
    assert calls == [(1, ["--num-digits", "3"]), (2, ["--num-digits", "3"])]
    assert train.main(["--seeds", "1", "--long-steps", "7"]) == 0
    assert calls[2:] == [(1, []), (1, ["--num-steps", "7"])]
