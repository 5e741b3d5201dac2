"""``replayrl bench memory`` on a real (small) ``replayrl train``: every actor and the launcher's
initial-files child show under their own names, and the tree's peak covers the largest one."""
from __future__ import annotations

from replayrl.tools.bench.memory import run_once
from tests.paths import REPO

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
ACTORS = {"rrl:engine_0", "rrl:trainer"}  # the launcher serves the clock and the manager itself


def test_a_run_reports_each_actor_by_name_and_a_tree_peak_above_each(tmp_path):
    run = run_once(REPO, tmp_path / "out", 2, SMALL, interval=0.1)
    assert ACTORS <= set(run.by_process), run.by_process
    assert "rrl:initial_fil" in run.by_process  # the launcher's torch child, apart from it
    biggest = max(r for r, _ in run.by_process.values())
    assert run.peak_rss_mib >= biggest > 0
    assert run.peak_pss_mib <= run.peak_rss_mib  # PSS splits shared pages, RSS counts each
    assert (tmp_path / "out" / "metrics.jsonl").read_text().count("\n") == 2
