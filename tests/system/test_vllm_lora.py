"""The evidence behind refusing ``--lora-rank`` with ``--rollout-engine vllm``
(docs/design/lora.md#lora), kept true: the installed vLLM, started with ``enable_lora`` on the MoE
policy replayrl serves, fails at its first forward in its Triton MoE-LoRA kernels (skipped where
vllm is not installed; CI runs it in its own venv, see .ci/run). When this test fails, vLLM
serves LoRA on MoE on CPU and the refusal in rollout/engines/vllm_run_check.py can be lifted.

The probe (tests/system/vllm_lora_probe.py) runs in its own process: a second in-process
``vllm.LLM`` would share the first's process-wide distributed state.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from tests.child_env import PYTHONPATH  # noqa: E402
from tests.paths import REPO  # noqa: E402


def _probe(kind: str) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "system" / "vllm_lora_probe.py"), kind],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllm_cpu_lora_fails_on_the_moe_policy_even_without_an_adapter():
    out = _probe("moe")
    assert out["requests"] == [], out  # the first request (no adapter) already fails
    assert "triton" in out["error"], out
    assert out["where"].startswith("vllm/model_executor/layers/fused_moe/"), out
