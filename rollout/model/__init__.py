"""The embedded default model: Qwen3-MoE math and HF parameter names, plus a DSA-style indexer.

Shared by rollout (engine, bf16 with a KV cache) and trainer (fp32, replaying the engine's traces).
The torch-backed names (the model, its output, the KV cache) import on first access, so a process
that only reads a ``ModelConfig`` (the rollout manager, the version clock, the command line) does
not load torch.
"""

import importlib

from replayrl.rollout.model.config import ModelConfig, default_config
from replayrl.rollout.model.errors import CheckpointError, ModelConfigError, ModelError, ModelInputError

_TORCH_BACKED = {
    "CausalLMOutput": "replayrl.rollout.model.qwen3_moe",
    "KVCache": "replayrl.rollout.model.kv_cache",
    "Qwen3MoeForCausalLM": "replayrl.rollout.model.qwen3_moe",
}

__all__ = [
    "CausalLMOutput",
    "CheckpointError",
    "KVCache",
    "ModelConfig",
    "ModelConfigError",
    "ModelError",
    "ModelInputError",
    "Qwen3MoeForCausalLM",
    "default_config",
]


def __getattr__(name: str):
    """The torch-backed name ``name`` of :data:`__all__`, imported now (PEP 562).

    Raises:
        AttributeError: ``name`` is not one of them.
    """
    module = _TORCH_BACKED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
