"""Shared test helper: tiny random checkpoints of the family room's model types, written by
transformers itself (`save_pretrained`, sharded), nothing downloaded."""
from __future__ import annotations

from pathlib import Path

import torch

FAMILY_TYPES = ("deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "gpt_oss")
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=97, max_position_embeddings=256)
_MLA = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_DSA = dict(index_topk=4, index_n_heads=2, index_head_dim=16)


def tiny_hf_config(model_type: str, **overrides):
    """A transformers config of `model_type`: hidden 64, 3 layers, 8 experts (top-2),
    `index_topk` 4 on DSA types; eager attention."""
    from transformers import AutoConfig

    kw = dict(_BASE)
    if model_type == "gpt_oss":
        kw.update(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8)
    else:
        kw.update(_MLA)
        if model_type != "glm4_moe_lite":
            kw.update(_DSA)
    kw.update(overrides)
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_hf_checkpoint(model_type: str, directory: Path, seed: int = 0, scale: float = 5.0,
                       **overrides):
    """Write a random tiny `model_type` checkpoint (sharded safetensors, transformers'
    `save_pretrained`) to `directory`; returns transformers' fp32 model (eval mode). Weights
    other than norms are scaled by `scale` so top-k choices are not near ties."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(model_type, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "sinks" not in name:
                p.mul_(scale)
    model.save_pretrained(directory, max_shard_size="60KB")
    return model.eval()


ALL_FAMILIES = (*FAMILY_TYPES, "deepseek_v3", "kimi_k25", "qwen3_5_moe", "deepseek_v4")
"""Every family room ``model_type`` (``qwen3_5_moe``: the multimodal composite, whose text model
is ``qwen3_5_moe_text``)."""


def any_family_checkpoint(model_type: str, directory: Path) -> Path:
    """A tiny random checkpoint of any of :data:`ALL_FAMILIES` (this module's, or
    tests/qwen35_kimi_checkpoints.py's, or tests/deepseek_v4_checkpoint.py's); returns
    ``directory``."""
    if model_type == "deepseek_v4":
        from tests.deepseek_v4_checkpoint import tiny_v4_checkpoint

        tiny_v4_checkpoint(directory)
    elif model_type in FAMILY_TYPES:
        tiny_hf_checkpoint(model_type, directory)
    else:
        from tests.qwen35_kimi_checkpoints import tiny_checkpoint

        tiny_checkpoint(model_type, directory)
    return directory


def padded_inputs(vocab: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of 12 token ids in ``[0, vocab)`` (int64 ``[2, 12]``, generator seeded
    ``seed``), their positions and a key padding mask (bool ``[2, 12]``) with the second row
    right-padded after 8 tokens (the trainer's layout)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    pos = torch.arange(12).expand(2, 12).clone()
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 8:] = False
    return ids, pos, mask
