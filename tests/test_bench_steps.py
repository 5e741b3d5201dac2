"""``replayrl bench steps`` (A/B of the step breakdown against a commit) and ``--priority``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import priority
from tools.bench_steps import table

ROOT = Path(__file__).resolve().parents[1]


def test_table_takes_the_median_over_runs_and_the_ratio():
    before = [{"step_seconds": 0.10, "train_seconds": 0.08}, {"step_seconds": 0.12},
              {"step_seconds": 0.30, "train_seconds": 0.06}]
    after = [{"step_seconds": 0.05, "train_seconds": 0.04}]
    lines = table("abc123", before, after).splitlines()
    assert lines[0] == "| key | abc123 | this checkout | this / abc123 |"
    assert "| `step_seconds` | 0.1200 | 0.0500 | 0.42 |" in lines  # median of 0.10, 0.12, 0.30
    assert "| `train_seconds` | 0.0700 | 0.0400 | 0.57 |" in lines


def test_priority_is_set_inside_the_block_and_restored_after(tmp_path, monkeypatch):
    fake = tmp_path / "autogroup"
    fake.write_text("/autogroup-7 nice 3\n")
    monkeypatch.setattr(priority, "AUTOGROUP", fake)
    with priority.autogroup_priority(False):
        assert fake.read_text() == "/autogroup-7 nice 3\n"  # off: untouched
    with priority.autogroup_priority(True):
        assert fake.read_text() == "-20\n"
    assert fake.read_text() == "3\n"


def test_priority_without_autogroups_is_a_named_error(tmp_path, monkeypatch):
    monkeypatch.setattr(priority, "AUTOGROUP", tmp_path / "missing")
    with pytest.raises(priority.PriorityError, match="CONFIG_SCHED_AUTOGROUP"):
        with priority.autogroup_priority(True):
            pass


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_bench_steps_runs_both_trees_and_prints_every_breakdown_key():
    out = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "steps", "--baseline",
                          "HEAD", "--runs", "1", "--steps", "3", "--warmup", "1"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| `")]
    keys = {row.split("`")[1] for row in rows}
    assert {"step_seconds", "train_seconds", "generate_seconds"} <= keys
    worktrees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"],
                               capture_output=True, text=True).stdout
    assert "replayrl-bench-steps" not in worktrees  # the baseline's worktree is removed


def test_bad_arguments_and_an_unknown_baseline_are_named():
    from tools.bench_steps import main

    with pytest.raises(SystemExit) as stop:
        main(["--baseline", "HEAD", "--steps", "2", "--warmup", "5"])
    assert stop.value.code == 2
    if (ROOT / ".git").exists():
        assert main(["--baseline", "no-such-revision-xyz", "--runs", "1"]) == 2
