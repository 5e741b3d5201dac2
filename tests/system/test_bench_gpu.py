"""``replayrl bench gpu`` as a user runs it: ``--dry-run`` checks the environment, prints the
plan and exits 0 on any machine; ``--device cpu`` runs the placement step and the training run
through the launcher on the CPU and records them in gpu.json. The other steps run in-process
in tests/unit/tools/test_bench_gpu.py; on a CUDA device, docs/gpu.md says how to run it."""
from __future__ import annotations

import json
import subprocess
import sys

from replayrl.tools.bench.gpu import STEPS


def _bench(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replayrl.tools.cli", "bench", "gpu", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_dry_run_prints_the_plan_and_exits_0(tmp_path):
    done = _bench("--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("replayrl bench gpu --device cuda: the plan on this machine")
    assert all(f"  {name}" in done.stdout for name in STEPS)
    assert "of a 10-minute device call" in done.stdout
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_on_the_cpu_the_check_places_and_trains(tmp_path):
    done = _bench("--device", "cpu", "--steps", "placement,train-run", "--model-size", "1m",
                  "--train-steps", "2", "--output-dir", str(tmp_path / "gpu"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "gpu" / "gpu.json").read_text())
    results = {r["name"]: r for r in record["results"]}
    assert sorted(results) == ["placement", "train-run"] and all(r["ok"] for r in results.values())
    placed = results["placement"]["figures"]
    assert placed["torch_weights"] == placed["fsdp_weights"] == placed["kv_cache"] == ["cpu"]
    assert placed["proximal_cache_pinned"] is False
    run = results["train-run"]["figures"]
    assert run["steps"] == 2 and run["returncode"] == 0 and run["routing_flip_rate_max"] == 0
    metrics = (tmp_path / "gpu" / "train-run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2
    assert "| parity | skipped |" in done.stdout
