"""bench limit (tools/bench/limit.py): its arithmetic by hand, and generation / training alone
running the real engine and trainer for two steps."""
from __future__ import annotations

import pytest

from replayrl.tools.bench import limit
from replayrl.tools.bench.peer import run_config
from replayrl.tools.bench.peer_grid import GridPoint
from replayrl.tools.errors import BenchError


def test_steady_median_leaves_out_the_warmup():
    assert limit.steady_median([9.0, 1.0, 3.0, 2.0], warmup=1) == 2.0
    assert limit.steady_median([9.0, 1.0, 4.0], warmup=1) == 2.5
    with pytest.raises(BenchError):
        limit.steady_median([1.0], warmup=1)


def test_ratios_to_the_two_limits_and_the_table():
    rest = dict.fromkeys(limit.REST_KEYS, 0.01)
    row = limit.LimitRow(GridPoint("1m", 2), generate=0.2, train=0.5, async_step=0.6,
                         sync_step=0.77, rest=rest, generate_cpu=0.2, train_cpu=0.9, cores=2)
    assert row.async_ratio == pytest.approx(0.6 / 0.5)   # overlap: the larger of the two
    assert row.sync_ratio == pytest.approx(0.77 / 0.7)   # sequential: their sum
    assert row.core_bound == pytest.approx((0.2 + 0.9) / 2)  # 1.1 CPU seconds on two cores
    assert row.bound_ratio == pytest.approx(0.6 / 0.55)  # the core bound is the larger here
    line = limit.table([row]).splitlines()[-1]
    assert line.startswith("| 1m x 2 | 0.200 | 0.500 | 0.600 | 1.20 | 0.770 | 1.10 | "
                           "(0.200 + 0.900) / 2 | 0.550 | 1.09 | 0.010 |")
    cores_to_spare = limit.LimitRow(GridPoint("1m", 2), generate=0.2, train=0.5, async_step=0.6,
                                    sync_step=0.77, rest=rest, generate_cpu=0.2, train_cpu=0.5,
                                    cores=16)
    assert cores_to_spare.bound_ratio == pytest.approx(0.6 / 0.5)  # then the larger of the two


@pytest.mark.parametrize("answer_tokens", [2, 8])  # the digits task; the sort task's verifier
def test_generation_and_training_alone_run_the_real_engine_and_trainer(tmp_path, answer_tokens):
    import torch

    threads = torch.get_num_threads()
    try:
        config = run_config(2, 1, str(tmp_path / "out"), {
            "rollout-batch-size": 2, "n-samples-per-prompt": 2,
            **GridPoint("1m", answer_tokens).overrides()})
        generate, train, generate_cpu, train_cpu = limit.alone(config, 2, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(generate) == len(train) == len(generate_cpu) == len(train_cpu) == 2
    assert min(generate + train + generate_cpu + train_cpu) > 0
