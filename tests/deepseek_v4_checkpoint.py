"""Shared test helper: a tiny random DeepSeek-V4 checkpoint written by transformers itself
(`save_pretrained`, sharded), nothing downloaded."""
from __future__ import annotations

from pathlib import Path

import torch

# every layer type: sliding window, CSA (4:1, the indexer keeps 2 entries), HCA (8:1 here, 128 in
# the released models) and another CSA; the first layer hash-routed, the others top-2 of 8
TINY_V4 = dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32,
               vocab_size=97, max_position_embeddings=256, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1,
               layer_types=["sliding_attention", "compressed_sparse_attention",
                            "heavily_compressed_attention", "compressed_sparse_attention"],
               mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
               hc_mult=2, hc_sinkhorn_iters=5, sliding_window=8, o_groups=2, o_lora_rank=16,
               index_n_heads=2, index_head_dim=16, index_topk=2, num_nextn_predict_layers=0,
               bos_token_id=0, eos_token_id=1)


def tiny_v4_config(**overrides):
    """transformers' `DeepseekV4Config` of the tiny shape (`TINY_V4` + `overrides`), eager."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("deepseek_v4", **{**TINY_V4, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def tiny_v4_checkpoint(directory: Path, seed: int = 0, scale: float = 3.0, **overrides):
    """Write a random tiny `deepseek_v4` checkpoint (sharded safetensors) to `directory`;
    returns transformers' fp32 model (eval mode). Weights other than norms, sinks and
    hyper-connection scales are scaled by `scale` so top-k choices are not near ties; every
    hash-routed layer gets a random table of distinct experts per token."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_v4_config(**overrides))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "sinks" not in name and "hc" not in name:
                p.mul_(scale)
            if name.endswith("position_bias"):
                p.normal_(0.0, 1.0, generator=g)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                e = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(e, generator=g)[: b.shape[1]]
                                     for _ in range(b.shape[0])]))
    model.save_pretrained(directory, max_shard_size="200KB")
    return model.eval()
