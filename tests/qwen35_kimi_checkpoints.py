"""Shared test helper: tiny random checkpoints of `deepseek_v3`, `kimi_k25` (a DeepSeek-V3 text
tower under a vision tower), `qwen3_5_moe_text` and `qwen3_5_moe` (the multimodal composite),
written by transformers itself (`save_pretrained`, sharded), nothing downloaded."""
from __future__ import annotations

from pathlib import Path

import torch

TYPES = ("deepseek_v3", "kimi_k25", "qwen3_5_moe_text", "qwen3_5_moe")
_DSV3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=97, max_position_embeddings=256,
             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
             topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0,
             tie_word_embeddings=False)
# four layers: three gated DeltaNet, the fourth full attention (transformers' default pattern)
_QWEN35 = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, vocab_size=97, max_position_embeddings=256, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
               num_experts_per_tok=2, tie_word_embeddings=False)
_VISION = {"kimi_k25": dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                            num_attention_heads=2),
           "qwen3_5_moe": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=64)}


def tiny_config(model_type: str, **text_overrides):
    """A transformers config of `model_type` (hidden 64, 8 experts top-2); for the composites
    `kimi_k25` / `qwen3_5_moe` the text config as `text_config` plus a one-layer vision tower."""
    from transformers import AutoConfig

    if model_type in ("deepseek_v3", "kimi_k25"):
        text = dict(_DSV3, **text_overrides)
        if model_type == "kimi_k25":
            return AutoConfig.for_model("kimi_k25", text_config=dict(model_type="deepseek_v3", **text),
                                        vision_config=_VISION[model_type], projection_hidden_size=32,
                                        tie_word_embeddings=False)
        return AutoConfig.for_model(model_type, **text)
    text = dict(_QWEN35, **text_overrides)
    if model_type == "qwen3_5_moe":
        return AutoConfig.for_model("qwen3_5_moe", text_config=text,
                                    vision_config=_VISION[model_type], tie_word_embeddings=False)
    return AutoConfig.for_model(model_type, **text)


def tiny_checkpoint(model_type: str, directory: Path, seed: int = 0, scale: float = 3.0,
                    **text_overrides):
    """Write a random tiny `model_type` checkpoint (sharded safetensors, transformers'
    `save_pretrained`) to `directory`; returns transformers' fp32 model of it, eval mode, eager
    attention (a composite: its image-text-to-text model). Weights other than norms are scaled
    by `scale` so top-k choices are not near ties."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **text_overrides)
    auto = AutoModelForImageTextToText if model_type in _VISION else AutoModelForCausalLM
    model = auto.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "A_log" not in name and "dt_bias" not in name:
                p.mul_(scale)
    model.save_pretrained(directory, max_shard_size="60KB")
    return model.eval()
