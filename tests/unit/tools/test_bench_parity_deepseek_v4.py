"""`replayrl bench parity --hf-checkpoint <tiny deepseek_v4>`: the embedded engine generates with
transformers' DeepSeek-V4 (its compressing cache), capturing the top-k routers' experts and the
CSA indexers' compressed-entry ids; the fp32 torch-trainer forward replays them: at equal
precision with every replay on no expert or entry flips and the logprobs agree to 1e-5."""
from __future__ import annotations

import torch

from replayrl.tools.bench.parity import generate, measure
from tests.deepseek_v4_checkpoint import tiny_v4_checkpoint


def test_deepseek_v4_parity_all_replays_on(tmp_path):
    tiny_v4_checkpoint(tmp_path)
    model, samples = generate(torch.float32, prompts=12, seed=1, top_k=20, response_len=6,
                              hf_checkpoint=str(tmp_path))
    assert all(s.routed_experts is not None and s.indexer_topk is not None for s in samples)
    assert any(bool((s.indexer_topk >= 0).any()) for s in samples)  # entries were chosen
    rows = {r.replays: r for r in measure(model, samples, "fp32")}
    same = rows["all on"]
    assert same.routing_flips == 0.0 and same.indexer_flips == 0.0 and same.max_abs <= 1e-5
