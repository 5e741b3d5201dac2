"""megatron_cpu_compat: every item is needed. With all items a tiny megatron-core GPTModel (dense
and MoE layers) runs forward, backward and an optimizer step on CPU; switching one item off
gives the failure that item exists for (tests/megatron_probe.py, one process per case)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from replayrl.trainer.backends import megatron_cpu_compat  # noqa: E402
from tests.child_env import PYTHONPATH
from tests.paths import REPO
from tests.ports import port_block

PROBE = str(REPO / "tests" / "megatron_probe.py")



def _probe(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    cmd = ([sys.executable, PROBE] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={port_block()}", PROBE])
    return subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_all_items_run_forward_backward_and_step():
    proc = _probe()
    assert proc.returncode == 0 and "PROBE OK" in proc.stdout, proc.stderr[-3000:]


# item -> (probe arguments, ranks, text that names the failure in the traceback)
CASES = {
    "current_device": ((), 1, ["in current_device", "Torch not compiled with CUDA enabled"]),
    "rng_tracker": ((), 1, ["random.py", "in get_rng_state", "Torch not compiled with CUDA enabled"]),
    "streams": ((), 1, ["torch.cuda.Stream requires CUDA support"]),
    "cuda_allocations": ((), 1, ["__torch_function__", "Torch not compiled with CUDA enabled"]),
    "param_type": ((), 1, ["clip_grads.py", "assert param.grad.type() == 'torch.cuda.FloatTensor'"]),
    "te_general_gemm": ((), 1, ["NameError: name 'te_general_gemm' is not defined"]),
    "alltoall_split_sizes": (("--ep", "2"), 2, ["all_to_all_single(): incompatible function arguments"]),
    "sp_layernorm": (("--tp", "2"), 2, ["sequence parallel not supported by torch LayerNorm"]),
    "cp_rotary": (("--cp", "2"), 2, ["in get_pos_emb_on_this_cp_rank",
                                     "pin_memory=True requires a CUDA or other accelerator"]),
}


def test_every_item_has_a_case():
    assert set(CASES) == set(megatron_cpu_compat.ITEMS)


@pytest.mark.parametrize("item", list(CASES))
def test_switching_an_item_off_gives_its_failure(item):
    args, nproc, needles = CASES[item]
    proc = _probe("--skip", item, *args, nproc=nproc)
    assert proc.returncode != 0 and "PROBE OK" not in proc.stdout
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr[-3000:])


def test_unknown_item_is_refused():
    with pytest.raises(megatron_cpu_compat.CompatError, match="unknown megatron CPU compat items"):
        megatron_cpu_compat.enable(skip=["no_such_item"])
