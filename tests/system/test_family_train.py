"""`replayrl train --hf-checkpoint <tiny random family checkpoint>`: engines and trainer run
transformers' model of the family (rollout/model/families/) with routing, indexer (DSA families)
and support replay on; the trainer's choices equal the engine's (flips 0) and the saved policy
loads in transformers. Two data paths: the built-in digit task (the embedded tokenizer) and
`examples/own_data` (its word-level tokenizer, chat template and prompt file).
Refusals before start: tests/unit/tools/test_run_config_families.py.
System tests: each starts a run's processes (~30-60 s on two CPU cores)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from replayrl.rollout.model.loader import load_pretrained
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import launch
from tests.child_env import PYTHONPATH
from tests.family_checkpoints import tiny_hf_checkpoint
from tests.paths import REPO

transformers = pytest.importorskip("transformers", reason="checkpoints are written by transformers")

_INDEXED = {"deepseek_v32": True, "glm_moe_dsa": True, "glm4_moe_lite": False}


async def _train_two_steps(tmp_path, family: str, extra: dict) -> None:
    """Two steps of `family`'s tiny checkpoint with the defaults (all replays on); asserts flips 0
    on every step and that the saved policy's logits equal transformers' reload of it."""
    tiny_hf_checkpoint(family, tmp_path / "ckpt")
    config = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "progress": False,
                           "num-steps": 2, "lr": 1e-3, "hf-checkpoint": str(tmp_path / "ckpt"),
                           "save-hf": str(tmp_path / "hf"), "output-dir": str(tmp_path / "run"),
                           **extra})
    assert config.trainer.use_routing_replay
    assert config.trainer.use_indexer_replay == _INDEXED[family]
    result = await launch(config)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["routing_flip_rate"] == 0.0 for r in rows)
    if _INDEXED[family]:
        assert all(r["indexer_flip_rate"] == 0.0 for r in rows)
    final, cfg = load_pretrained(tmp_path / "hf" / "step-2")
    assert cfg.family == family
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "step-2",
                                                           dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids, pos = torch.tensor([[1, 4, 5, 6, 7, 9]]), torch.arange(6)[None]
    with torch.no_grad():
        torch.testing.assert_close(final.eval()(ids, pos).logits,
                                   hf(input_ids=ids, position_ids=pos).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32", "glm4_moe_lite"])
async def test_train_tiny_family_on_builtin_task_with_all_replays_on(tmp_path, family):
    await _train_two_steps(tmp_path, family, {})


async def test_train_tiny_glm5_on_own_data_with_all_replays_on(tmp_path):
    out = tmp_path / "own_data"
    subprocess.run([sys.executable, str(REPO / "examples" / "own_data" / "make_data.py"), str(out)],
                   check=True, env={**os.environ, "PYTHONPATH": PYTHONPATH}, capture_output=True, timeout=300)
    await _train_two_steps(tmp_path, "glm_moe_dsa", {
        "tokenizer": str(out / "checkpoint"), "prompt-data": str(out / "train.jsonl"),
        "apply-chat-template": True, "rm-type": "exact"})
