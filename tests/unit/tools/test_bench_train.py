"""``replayrl bench train``: the training-table row against values computed by hand."""
from __future__ import annotations

import pytest

from replayrl.tools.bench.train import table_row


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
    row = table_row(2, _rows(rewards, gaps, seconds, flips), wall_seconds=31.4)
    assert row == "| 2 | 0.200 | 0.900 | 4.5x | 0.0200 | 0.25 / 0 | 10 | 31 |"


def test_absent_values_are_not_zero():
    rows = _rows([0.0, 0.5], [None, None], [1.0, 1.0])  # no flip keys, no finite gap
    assert table_row(1, rows, 3.0) == "| 1 | 0.000 | 0.500 | n/a | n/a | n/a / n/a | 2 | 3 |"


def test_no_rows_is_an_error():
    with pytest.raises(ValueError):
        table_row(1, [], 1.0)
