"""Acceptance: ``replayrl train --rollout-engine sglang --sglang-urls URL`` against
``replayrl serve`` on loopback trains like the in-process embedded engine (same seed: the same
first-step batch and the same metrics), through the real multi-process system."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from replayrl.actors import Directory, Supervisor  # noqa: E402
from replayrl.rollout.sample import TRACE_FIELDS, samples_from_columns  # noqa: E402
from replayrl.tools.run.from_flags import build_config  # noqa: E402
from replayrl.tools.run.launcher import actor_specs, write_initial_checkpoint  # noqa: E402
from replayrl.tools.run.train_loop import train_loop  # noqa: E402
from tests.child_env import PYTHONPATH
from tests.paths import REPO

SMALL = {"rollout-batch-size": 4, "n-samples-per-prompt": 4, "progress": False, "seed": 3}
TIMING = ("seconds", "per_second")  # wall-clock figures differ between any two runs


@pytest.fixture(scope="module")
def serve_url():
    # the embedded default policy: serve takes train's model flags only (none needed here)
    proc = subprocess.Popen([sys.executable, "-m", "replayrl.tools.cli", "serve", "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": PYTHONPATH})
    try:
        line = proc.stdout.readline()  # "serving on URL" once bound (torch import: seconds)
        assert line.startswith("serving on http://"), line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(30)


async def _first_step_and_batch(config, tmp_path: Path, name: str) -> tuple[dict, list]:
    """The run's first step through the driver loop (push, generate, train; its metrics row),
    then rollout 1 generated on the same actors and taken as samples. One start of the actors
    serves both (the run and a separate batch each started them once: twice the cost)."""
    rows: list[dict] = []
    async with _actors(config, tmp_path, name) as directory:
        await train_loop(directory, config, rows.append)
        await directory.ref("rollout_manager").call("generate", 1)
        return rows[0], samples_from_columns(await directory.ref("rollout_manager")
                                             .call("take_batch", 1))


@contextlib.asynccontextmanager
async def _actors(config, tmp_path: Path, name: str):
    """The run's actors started from its initial checkpoint, under a Supervisor; yields their
    Directory."""
    checkpoint = write_initial_checkpoint(config, tmp_path / f"ckpt-{name}")
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        specs = actor_specs(config, checkpoint)
        directory = Directory.for_run(run_dir, [s.name for s in specs])
        async with Supervisor(specs, directory, run_dir):
            yield directory


async def test_first_step_batch_and_metrics_equal_the_embedded_engine(serve_url, tmp_path):
    embedded = build_config({**SMALL, "num-steps": 1, "output-dir": str(tmp_path / "e")})
    sglang = build_config({**SMALL, "num-steps": 1, "output-dir": str(tmp_path / "s"),
                           "rollout-engine": "sglang", "sglang-urls": serve_url})
    a, want = await _first_step_and_batch(embedded, tmp_path, "e")
    b, got = await _first_step_and_batch(sglang, tmp_path, "s")
    _assert_same(a, want, b, got)


async def test_weights_by_group_broadcast_or_by_the_trainers_file_train_alike(serve_url, tmp_path):
    """The SGLang client's other two weight paths against ``replayrl serve``, two synchronous
    steps (so rollout 1 is generated from the second push): ``--weight-sync dist`` (the server
    joins the trainer's group through ``/init_weights_update_group`` and receives each push
    through ``/update_weights_from_distributed``) and ``--weight-sync disk`` (the server reads
    the trainer's own file) train as the embedded engine does."""
    steps = {**SMALL, "num-steps": 2, "max-staleness": 0}
    want = await _rows(build_config({**steps, "output-dir": str(tmp_path / "e")}), tmp_path, "e")
    for sync in ("dist", "disk"):
        got = await _rows(build_config({**steps, "output-dir": str(tmp_path / sync),
                                        "rollout-engine": "sglang", "sglang-urls": serve_url,
                                        "weight-sync": sync}), tmp_path, sync)
        assert [r["trainer_version"] for r in got] == [1, 2]
        for a, b in zip(want, got):
            compared = [k for k in a if isinstance(a[k], (int, float)) and not k.endswith(TIMING)]
            assert {"reward_mean", "train_rollout_logprob_abs_diff", "grad_norm"} <= set(compared)
            for key in compared:
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (sync, a["step"], key)
    # three pushes (v0, and one after each synchronous step); the trainer keeps the last two
    assert sorted(p.name for p in (tmp_path / "disk" / "weight-sync").iterdir()) == \
        ["version-1", "version-2"]


async def _rows(config, tmp_path: Path, name: str) -> list[dict]:
    """The metrics rows of the run of ``config`` through the driver loop."""
    rows: list[dict] = []
    async with _actors(config, tmp_path, name) as directory:
        await train_loop(directory, config, rows.append)
    return rows


def _assert_same(a: dict, want: list, b: dict, got: list) -> None:
    """Rollout 1's samples and the first step's metrics of two runs agree."""
    assert len(got) == len(want) == 16
    for g, w in zip(got, want):
        assert (g.sample_id, g.group_id, g.status, g.policy_version) == \
            (w.sample_id, w.group_id, w.status, w.policy_version)
        assert g.reward == w.reward
        for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", *TRACE_FIELDS):
            np.testing.assert_array_equal(getattr(g, name), getattr(w, name), err_msg=name)

    assert set(a) == set(b)
    compared = [k for k in a if isinstance(a[k], (int, float)) and not k.endswith(TIMING)]
    assert {"reward_mean", "train_rollout_logprob_abs_diff", "routing_flip_rate"} <= set(compared)
    for key in compared:  # the same batch trains the same: equal up to float rounding
        assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
