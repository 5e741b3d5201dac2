"""`replayrl train --hf-checkpoint <tiny random GLM-5>`: engines and trainer run transformers'
`glm_moe_dsa` model (rollout/model/families/) with routing, indexer and support replay on; the
trainer's choices equal the engine's (flips 0) and the saved policy loads in transformers.
Refusals before start: tests/unit/tools/test_run_config_families.py.
A system test: it starts the run's processes (~1 min on two CPU cores)."""
from __future__ import annotations

import json

import pytest
import torch

from replayrl.rollout.model.loader import load_pretrained
from replayrl.tools.run.config import build_config
from replayrl.tools.run.launcher import launch
from tests.family_checkpoints import tiny_hf_checkpoint

transformers = pytest.importorskip("transformers", reason="checkpoints are written by transformers")


async def test_train_tiny_glm5_with_all_replays_on(tmp_path):
    tiny_hf_checkpoint("glm_moe_dsa", tmp_path / "ckpt")
    config = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "progress": False,
                           "num-steps": 2, "lr": 1e-3, "hf-checkpoint": str(tmp_path / "ckpt"),
                           "save-hf": str(tmp_path / "hf"), "output-dir": str(tmp_path / "run")})
    assert config.trainer.use_routing_replay and config.trainer.use_indexer_replay
    result = await launch(config)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["routing_flip_rate"] == 0.0 and r["indexer_flip_rate"] == 0.0 for r in rows)
    final, cfg = load_pretrained(tmp_path / "hf" / "step-2")
    assert cfg.family == "glm_moe_dsa"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "step-2",
                                                           dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids, pos = torch.tensor([[1, 4, 5, 6, 7, 9]]), torch.arange(6)[None]
    with torch.no_grad():
        torch.testing.assert_close(final.eval()(ids, pos).logits,
                                   hf(input_ids=ids, position_ids=pos).logits, atol=1e-5, rtol=0)
