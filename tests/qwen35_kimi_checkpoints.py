"""Shared test helper: tiny random checkpoints of `deepseek_v3`, `kimi_k25` (a DeepSeek-V3 text
tower under a vision tower), `qwen3_5_moe_text` and `qwen3_5_moe` (the multimodal composite),
written by transformers itself (`save_pretrained`, sharded), nothing downloaded; the shapes and
the writer are examples/tiny_checkpoints/make_family_checkpoint.py's (tests/family_checkpoints.py
`TINY`)."""
from __future__ import annotations

from pathlib import Path

from tests.family_checkpoints import TINY as tiny

TYPES = ("deepseek_v3", "kimi_k25", "qwen3_5_moe_text", "qwen3_5_moe")


def tiny_config(model_type: str, **text_overrides):
    """A transformers config of `model_type` (hidden 64, 8 experts top-2); for the composites
    `kimi_k25` / `qwen3_5_moe` the text config as `text_config` plus a one-layer vision tower."""
    return tiny.tiny_config(model_type, **text_overrides)


def tiny_checkpoint(model_type: str, directory: Path, seed: int = 0, scale: float = 3.0,
                    **text_overrides):
    """Write a random tiny `model_type` checkpoint (sharded safetensors, transformers'
    `save_pretrained`) to `directory`; returns transformers' fp32 model of it, eval mode, eager
    attention (a composite: its image-text-to-text model). Weights other than norms are scaled
    by `scale` so top-k choices are not near ties."""
    return tiny.tiny_checkpoint(model_type, directory, seed, scale, **text_overrides)
