"""``replayrl bench steps`` (A/B of the step breakdown against a commit) and ``--priority``."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from replayrl.tools.bench import priority
from replayrl.tools.bench import steps as bench_steps
from replayrl.tools.bench.steps import run_medians, table
from tests.paths import REPO

ROOT = REPO


def test_table_takes_the_median_over_runs_and_the_ratio():
    before = [{"step_seconds": 0.10, "train_seconds": 0.08}, {"step_seconds": 0.12},
              {"step_seconds": 0.30, "train_seconds": 0.06}]
    after = [{"step_seconds": 0.05, "train_seconds": 0.04}]
    lines = table("abc123", before, after).splitlines()
    assert lines[0] == "| key | A: abc123 | B: this checkout | B / A |"
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


SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]


def test_one_run_gives_the_median_of_every_seconds_key_over_its_steady_steps(tmp_path):
    # a real `replayrl train` (small batch: the plumbing, not the figures); with 3 steps and
    # warmup 1 the steady steps are step 1 alone (the last step has no overlapping generation)
    medians = run_medians(ROOT, 3, 1, tmp_path / "out", SMALL)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert medians == {k: v for k, v in rows[1].items() if k.endswith("_seconds")}
    assert {"step_seconds", "train_seconds", "generate_seconds"} <= set(medians)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rollout"]["rollout_batch_size"] == 2


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_bench_steps_alternates_runs_of_the_baseline_worktree_and_this_checkout(monkeypatch, capsys):
    # the runs themselves are run_medians (tested above on a real run); here: which trees, in
    # what order, with which flags, the table, and the worktree removed afterwards
    def commit(tree: Path) -> str:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()

    calls = []

    def fake_run(tree, steps, warmup, output_dir, extra):
        calls.append((tree == ROOT, commit(tree), steps, warmup, list(extra)))
        return {"step_seconds": 1.0 if tree == ROOT else 2.0, "train_seconds": 0.5}

    monkeypatch.setattr(bench_steps, "run_medians", fake_run)
    assert bench_steps.main(["--baseline", "HEAD", "--runs", "2", "--steps", "3", "--warmup", "1",
                             "--", *SMALL]) == 0
    head = commit(ROOT)
    assert calls == [(False, head, 3, 1, SMALL), (True, head, 3, 1, SMALL)] * 2
    out = capsys.readouterr().out
    assert "| `step_seconds` | 2.0000 | 1.0000 | 0.50 |" in out
    assert "| `train_seconds` | 0.5000 | 0.5000 | 1.00 |" in out
    worktrees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"],
                               capture_output=True, text=True).stdout
    assert "replayrl-baseline-" not in worktrees  # the baseline's worktree is removed


def test_bad_arguments_and_an_unknown_baseline_are_named():
    from replayrl.tools.bench.steps import main

    with pytest.raises(SystemExit) as stop:
        main(["--baseline", "HEAD", "--steps", "2", "--warmup", "5"])
    assert stop.value.code == 2
    if (ROOT / ".git").exists():
        assert main(["--baseline", "no-such-revision-xyz", "--runs", "1"]) == 2


def test_a_variant_alone_compares_this_checkout_with_and_without_its_flags(monkeypatch, capsys):
    calls = []

    def fake_run(tree, steps, warmup, output_dir, extra):
        calls.append((tree == ROOT, list(extra)))
        return {"step_seconds": 3.0 if "--engine-torch-threads" in extra else 4.0}

    monkeypatch.setattr(bench_steps, "run_medians", fake_run)
    assert bench_steps.main(["--variant", "--engine-torch-threads 2", "--runs", "1", "--steps", "3",
                             "--warmup", "1", "--", *SMALL]) == 0
    assert calls == [(True, SMALL), (True, [*SMALL, "--engine-torch-threads", "2"])]
    assert "| `step_seconds` | 4.0000 | 3.0000 | 0.75 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_steps.main(["--runs", "1"])  # neither --baseline nor --variant: nothing to compare
