"""The embedded default model: Qwen3-MoE math and HF parameter names, plus a DSA-style indexer.

Shared by rollout (engine, bf16 with a KV cache) and trainer (fp32, replaying the engine's traces).
"""

from replayrl.rollout.model.config import ModelConfig, default_config
from replayrl.rollout.model.errors import CheckpointError, ModelConfigError, ModelError, ModelInputError
from replayrl.rollout.model.kv_cache import KVCache
from replayrl.rollout.model.qwen3_moe import CausalLMOutput, Qwen3MoeForCausalLM

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
