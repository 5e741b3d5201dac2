"""Exact resume of the core cell (torch backend, embedded model, asynchronous loop): a run
SIGKILLed, whole process group, while its last checkpoint is written has written every row;
resumed with ``--load`` of an earlier checkpoint into the same output directory it trains those
steps again (the first on the batch the checkpoint prefetched, the next on a batch generated
after the resume) and writes the same rows on every key but the timings. The full matrix is
``replayrl bench resume`` (docs/benchmarks.md, Fault tolerance)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from replayrl.rollout.dispatch.prefetched import FILE_NAME
from replayrl.tools.bench.resume import argv_of
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.checkpoint_dirs import latest_checkpoint
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import check_load, launch
from tests.child_env import PYTHONPATH

FLAGS = {"rollout-batch-size": 4, "n-samples-per-prompt": 4, "num-steps": 3, "save-interval": 1,
         "seed": 1}


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if "second" not in k}


async def test_a_run_killed_while_checkpointing_resumes_to_the_uninterrupted_rows(tmp_path):
    killed = tmp_path / "killed"
    child = subprocess.run(
        [sys.executable, "-m", "replayrl.tools.bench.kill_in_save", "3", "--no-progress",
         *argv_of({**FLAGS, "output-dir": killed})],
        env={**os.environ, "PYTHONPATH": PYTHONPATH}, start_new_session=True,
        capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stdout + child.stderr  # the group's SIGKILL
    saved = killed / "checkpoints"
    assert sorted(p.name for p in saved.iterdir()) == ["step-1", "step-2", "step-3.partial"]
    # killed after the trainer's and the manager's files, before the run state and the rename
    assert sorted(p.name for p in (saved / "step-3.partial").iterdir()) == sorted(
        ["model", "trainer_state.pt"])  # nothing prefetched after the last step
    assert sorted(p.name for p in (saved / "step-1").iterdir()) == sorted(
        ["model", "trainer_state.pt", FILE_NAME, "run_state.json"])
    uninterrupted = _rows(killed / "metrics.jsonl")  # every row was written before the kill
    assert [r["step"] for r in uninterrupted] == [0, 1, 2]
    assert latest_checkpoint(saved) == saved / "step-2"
    with pytest.raises(ConfigError, match=r"step-3\.partial: not a readable replayrl checkpoint"
                                          r".*run_state\.json"):
        check_load(build_config({**FLAGS, "output-dir": str(killed),
                                 "load": str(saved / "step-3.partial")}))  # never loaded

    resumed = await launch(build_config({**FLAGS, "progress": False, "output-dir": str(killed),
                                         "load": str(saved / "step-1")}))
    rows = _rows(resumed.metrics_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # step 1 trains the batch prefetched before step-1 was saved, one version stale as
    # uninterrupted (drawn again from the restored policy it would be on-policy: staleness 0)
    assert rows[1]["staleness_max"] == 1
    assert [_untimed(r) for r in rows] == [_untimed(r) for r in uninterrupted]

    # a damaged prefetched rollout is refused before any process starts, naming the file
    cut = saved / "step-1" / FILE_NAME
    cut.write_bytes(cut.read_bytes()[:64])
    with pytest.raises(ConfigError, match=rf"--load .*step-1: RolloutError: .*{FILE_NAME}: not a "
                                          r"prefetched rollout"):
        check_load(build_config({**FLAGS, "output-dir": str(killed), "load": str(saved / "step-1")}))
