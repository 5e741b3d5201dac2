"""`replayrl bench parity --hf-checkpoint` on tiny Qwen3.5-MoE and Kimi K2.5 checkpoints: the
embedded engine generates with transformers' model (DeltaNet layers from their carried
convolution and recurrent state; MLA), capturing routed experts; the fp32 torch-trainer forward
replays them: at equal precision no expert flips and the logprobs agree within 1e-5."""
from __future__ import annotations

import pytest
import torch

from replayrl.tools.bench.parity import generate, measure
from tests.qwen35_kimi_checkpoints import tiny_checkpoint


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "kimi_k25"])
def test_fp32_parity_all_replays_on(model_type, tmp_path):
    tiny_checkpoint(model_type, tmp_path)
    model, samples = generate(torch.float32, prompts=4, seed=1, top_k=20, response_len=4,
                              hf_checkpoint=str(tmp_path))
    assert all(s.routed_experts is not None and s.indexer_topk is None for s in samples)
    rows = {r.replays: r for r in measure(model, samples, "fp32")}
    assert rows["all on"].routing_flips == 0.0 and rows["all on"].max_abs <= 1e-5
