"""Shared test helper: tiny random checkpoints of the family room's model types, written by
transformers itself (`save_pretrained`, sharded), nothing downloaded. The shapes and the writer
are examples/tiny_checkpoints/make_family_checkpoint.py's (:data:`TINY`), the script a reader
makes the same checkpoints with."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from tests.paths import REPO


def _load_tiny() -> ModuleType:
    """examples/tiny_checkpoints/make_family_checkpoint.py as the module
    ``make_family_checkpoint`` (examples/ is no package), loaded once per process."""
    name = "make_family_checkpoint"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, REPO / "examples" / "tiny_checkpoints" / "make_family_checkpoint.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


TINY = _load_tiny()
"""The example script's module: ``TINY_TYPES``, ``TINY_V4``, ``tiny_config``, ``tiny_checkpoint``."""
tiny_config, tiny_checkpoint = TINY.tiny_config, TINY.tiny_checkpoint

FAMILY_TYPES = TINY.DSA_TYPES


def tiny_hf_config(model_type: str, **overrides):
    """A transformers config of `model_type` (the example's `tiny_config`:
    hidden 64, 3 layers, 8 experts (top-2), `index_topk` 4 on DSA types; eager attention)."""
    return tiny_config(model_type, **overrides)


def tiny_hf_checkpoint(model_type: str, directory: Path, seed: int = 0, scale: float = 5.0,
                       **overrides):
    """Write a random tiny `model_type` checkpoint (sharded safetensors, transformers'
    `save_pretrained`) to `directory`; returns transformers' fp32 model (eval mode). Weights
    other than norms are scaled by `scale` so top-k choices are not near ties
    (the example's `tiny_checkpoint`)."""
    return tiny_checkpoint(model_type, directory, seed, scale, **overrides)


ALL_FAMILIES = (*FAMILY_TYPES, "deepseek_v3", "kimi_k25", "qwen3_5_moe", "deepseek_v4")
"""Every family room ``model_type`` (``qwen3_5_moe``: the multimodal composite, whose text model
is ``qwen3_5_moe_text``)."""


def any_family_checkpoint(model_type: str, directory: Path) -> Path:
    """A tiny random checkpoint of any of :data:`ALL_FAMILIES`
    (the example's `tiny_checkpoint`, default seed and scale);
    returns ``directory``."""
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
