"""The parity and engine benchmarks with vLLM generating (skipped where vllm is not installed;
CI runs them in their own venv, see .ci/run)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from replayrl.tools.bench.engine import main as bench_engine  # noqa: E402
from replayrl.tools.bench.parity import run, table  # noqa: E402


def test_replays_make_the_trainer_match_vllm():
    rows = {(r.precision, r.replays): r for r in run(prompts=24, seed=3, response_len=4,
                                                        engine="vllm")}
    assert {replays for _, replays in rows} == {"all off", "routing (R3)", "support", "all on"}
    same, same_off = rows[("vllm fp32 / fp32", "all on")], rows[("vllm fp32 / fp32", "all off")]
    # equal precision: vLLM's sampled logprobs are the trainer's within fp32 kernel rounding
    assert same.routing_flips == 0 and same.max_abs <= 1e-5
    assert same_off.max_abs >= 10 * same.max_abs
    on, off = rows[("vllm bf16 / fp32", "all on")], rows[("vllm bf16 / fp32", "all off")]
    assert on.routing_flips == 0 and rows[("vllm bf16 / fp32", "routing (R3)")].routing_flips == 0
    assert off.mean_abs >= 10 * on.mean_abs
    assert "| vllm bf16 / fp32 | all on |" in table(list(rows.values()))
    assert "| n/a |" in table(list(rows.values()))  # no indexer: no indexer flip rate, not 0


def test_engine_bench_reports_both_engines(capsys):
    assert bench_engine(["--batch-size", "4", "--batches", "1", "--response-len", "4"]) == 0
    out = capsys.readouterr().out
    assert "| embedded |" in out and "| vllm |" in out and "1.00x" in out
