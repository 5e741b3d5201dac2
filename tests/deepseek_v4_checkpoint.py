"""Shared test helper: a tiny random DeepSeek-V4 checkpoint written by transformers itself
(`save_pretrained`, sharded), nothing downloaded; the shape and the writer are
examples/tiny_checkpoints/make_family_checkpoint.py's (tests/family_checkpoints.py `TINY`)."""
from __future__ import annotations

from pathlib import Path

from tests.family_checkpoints import TINY, tiny_checkpoint, tiny_config

TINY_V4 = TINY.TINY_V4

__all__ = ["TINY_V4", "tiny_v4_config", "tiny_v4_checkpoint"]


def tiny_v4_config(**overrides):
    """transformers' `DeepseekV4Config` of the tiny shape (`TINY_V4` + `overrides`), eager."""
    return tiny_config("deepseek_v4", **overrides)


def tiny_v4_checkpoint(directory: Path, seed: int = 0, scale: float = 3.0, **overrides):
    """Write a random tiny `deepseek_v4` checkpoint (sharded safetensors) to `directory`;
    returns transformers' fp32 model (eval mode). Weights other than norms, sinks and
    hyper-connection scales are scaled by `scale` so top-k choices are not near ties; every
    hash-routed layer gets a random table of distinct experts per token."""
    return tiny_checkpoint("deepseek_v4", directory, seed, scale, **overrides)
