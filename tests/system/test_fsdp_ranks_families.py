"""--train-backend fsdp at --dp-size 2 on every --hf-checkpoint family (docs/trainer-ranks.md#fsdp):
one replayed step of the two ranks, each on its half of the batch, equals the one-rank step.

Two rank processes (gloo, tests/fsdp_family_worker.py) takes the step on every family's tiny
checkpoint in turn, while this process takes the one-rank step of each (a world-size-1 group):
the preflight's logprobs within 1e-5, the replayed routing and indexer choices are the engine's
(flips 0 on both), the gradient norm within rel 1e-5, AdamW's first moment (0.1 x the gradient)
and the weights after the step as tests/rank_checks.py's ``assert_same_update``."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="checkpoints are written by transformers")

from replayrl.trainer.backends.fsdp_backend import FSDPBackend  # noqa: E402
from replayrl.trainer.config import TrainerConfig  # noqa: E402
from tests.child_env import PYTHONPATH  # noqa: E402
from tests.family_checkpoints import ALL_FAMILIES, any_family_checkpoint  # noqa: E402
from tests.fsdp_family_worker import one_step, step_batch  # noqa: E402
from tests.paths import REPO  # noqa: E402
from tests.ports import port_block  # noqa: E402
from tests.rank_checks import assert_same_update  # noqa: E402

WORKER = str(REPO / "tests" / "fsdp_family_worker.py")
FAMILIES = ALL_FAMILIES


def _run_ranks(root: Path, ckpts: list[str]) -> list[subprocess.Popen]:
    """Start the two rank processes (env:// rendezvous, without torchrun's launcher process)."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port_block())}
    return [subprocess.Popen([sys.executable, WORKER, str(root / "out"), *ckpts], cwd=REPO,
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(2)]


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    """Each rank's output once it exited (a rank still running after 600 s is killed)."""
    try:
        return [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()


def _report(procs: list[subprocess.Popen], outputs: list[str]) -> str:
    """Every rank's exit status and the tail of its output: the rank that died first is the one
    to read (its peer then only reports a reset gloo connection)."""
    return "\n".join(f"--- rank {r}: exit {proc.returncode}\n{out[-3000:]}"
                     for r, (proc, out) in enumerate(zip(procs, outputs)))


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """(family -> the DP=2 result, family -> (the DP=1 result, the weights before)): the two
    ranks run while this process takes the one-rank steps."""
    root = tmp_path_factory.mktemp("families")
    ckpts = [str(any_family_checkpoint(f, root / f)) for f in FAMILIES]
    procs = _run_ranks(root, ckpts)
    threads = torch.get_num_threads()
    try:
        one = {}
        for family, ckpt in zip(FAMILIES, ckpts):
            batch, weights = step_batch(Path(ckpt))
            one[family] = one_step(FSDPBackend(ckpt, TrainerConfig(train_backend="fsdp"), []),
                                   batch, weights, 1)
        outputs = _finish(procs)
        if any(proc.returncode < 0 for proc in procs):
            # a rank ended by a signal from outside (the code never signals itself): the shared
            # machine's doing, not the step's; the pair runs once more, and a second such end fails
            warnings.warn(f"a rank was killed by a signal; the ranks run again:\n"
                          f"{_report(procs, outputs)}", stacklevel=2)
            procs = _run_ranks(root, ckpts)
            outputs = _finish(procs)
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert all(proc.returncode == 0 for proc in procs), _report(procs, outputs)
    result = dict(np.load(root / "out" / "result.npz"))
    two = {f: {k[len(f"c{i}_"):]: v for k, v in result.items() if k.startswith(f"c{i}_")}
           for i, f in enumerate(FAMILIES)}
    return two, one


@pytest.mark.parametrize("family", FAMILIES)
def test_two_fsdp_ranks_take_one_ranks_replayed_step(steps, family):
    two, (one, start) = steps[0][family], steps[1][family]
    np.testing.assert_allclose(two["logprobs"], one["logprobs"], rtol=0, atol=1e-5)
    # the replays ran: every rank and the one rank used the engine's experts and indexer keys
    assert list(two["routing_flips"]) == [0.0, 0.0] and one["routing_flips"] == 0.0
    assert list(two["indexer_flips"]) == [0.0, 0.0] and one["indexer_flips"] == 0.0
    assert float(two["grad_norm"]) == pytest.approx(float(one["grad_norm"]), rel=1e-5)
    state = [k for k in one if "/" in k]
    assert_same_update({k: one[k].ravel() for k in state}, {k: two[k].ravel() for k in state},
                       {k: v.ravel() for k, v in start.items()}, TrainerConfig().lr)
