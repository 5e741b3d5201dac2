"""`replayrl bench parity --hf-checkpoint` on the family room's model types: the embedded engine
generates with transformers' model (its DynamicCache), capturing routed experts and indexer
top-k; the fp32 torch-trainer forward replays them: at equal precision no expert or key flips and
the logprobs agree, and with a bf16 engine the replays cut the mean logprob gap at least tenfold
(docs/design/model.md#hf-checkpoints, the families)."""
from __future__ import annotations

import pytest
import torch

from replayrl.tools.bench.parity import generate, measure
from tests.family_checkpoints import FAMILY_TYPES, tiny_hf_checkpoint


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_family_parity_all_replays_on(model_type, tmp_path):
    tiny_hf_checkpoint(model_type, tmp_path)
    rows = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model, samples = generate(dtype, prompts=12, seed=1, top_k=20, response_len=6,
                                  hf_checkpoint=str(tmp_path))
        assert all(s.routed_experts is not None for s in samples)
        assert all((s.indexer_topk is not None) == bool(model.config.indexed_layers)
                   for s in samples)
        rows.update({(label, r.replays): r for r in measure(model, samples, label)})
    same = rows[("fp32", "all on")]
    assert same.routing_flips == 0.0 and same.max_abs <= 1e-5
    if model_type in ("deepseek_v32", "glm_moe_dsa"):
        assert same.indexer_flips == 0.0
    assert rows[("bf16", "all on")].mean_abs * 10 <= rows[("bf16", "all off")].mean_abs
