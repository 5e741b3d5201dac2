"""The trainer backends on the Qwen3.5-MoE and Kimi K2.5 families (rollout/model/families/):
the torch backend's replayed forward uses the engine's experts at every MoE layer (right-padded
rows, DeltaNet layers included), and --train-backend fsdp on one rank (a world-size-1 gloo
group) takes the torch backend's step; the fsdp HF save loads in transformers with the torch
backend's logits. Several ranks: `replayrl train --train-backend fsdp --dp-size 2`
(docs/benchmarks.md, "Training a tiny GLM-5")."""
from __future__ import annotations

import pytest
import torch

from replayrl.rollout.model.families.base import FamilyModel
from replayrl.trainer.backends.fsdp_backend import FSDPBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.config import TrainerConfig
from tests.backend_fixtures import assert_fsdp_takes_the_torch_step, assert_hf_save_gives_the_logits, traced_samples
from tests.qwen35_kimi_checkpoints import tiny_checkpoint

transformers = pytest.importorskip("transformers", reason="checkpoints are written by transformers")
pytestmark = pytest.mark.usefixtures("one_rank_group")


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "kimi_k25"])
def test_fsdp_takes_the_torch_step_with_the_engines_experts(model_type, tmp_path):
    tiny_checkpoint(model_type, tmp_path / "ckpt")
    reference = TorchBackend(str(tmp_path / "ckpt"), TrainerConfig(), [])
    fsdp = FSDPBackend(str(tmp_path / "ckpt"), TrainerConfig(train_backend="fsdp"), [])
    assert isinstance(fsdp.model, FamilyModel)
    batch = collate(traced_samples(reference.model, 97, prompt_len=6), routing=True,
                    indexer=False, support=True)
    _, got = assert_fsdp_takes_the_torch_step(reference, fsdp, batch, atol=1e-5, rel=1e-5)
    traced = (batch.routed_experts >= 0).all(-1)
    assert int(traced.sum()) > 0
    assert torch.equal(got.routed_experts[traced], batch.routed_experts[traced].to(torch.int32))
    assert_hf_save_gives_the_logits(fsdp, reference, tmp_path / "out")  # deepseek_v3 / qwen3_5_moe_text
