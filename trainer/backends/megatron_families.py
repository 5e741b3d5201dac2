"""Which family room policies (``--hf-checkpoint`` of rollout/model/families/) the megatron backend
trains, and what of the others it does not build yet: data only, read by the run check
(:mod:`replayrl.trainer.backends.megatron_run_check`) and the model mapping
(:mod:`replayrl.trainer.backends.megatron_mla`); docs/design/megatron.md#megatron-families."""
from __future__ import annotations

__all__ = ["MEGATRON_FAMILIES", "NOT_YET"]

MEGATRON_FAMILIES = ("deepseek_v3", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
"""Family room model types the megatron backend trains: megatron-core's MLA and sigmoid-routed
MoE (:mod:`replayrl.trainer.backends.megatron_mla`), with megatron-core's DSA indexer and sparse
attention on DeepSeek-V3.2 / GLM-5 (:mod:`replayrl.trainer.backends.megatron_dsa`). A ``qwen3`` /
``qwen3_moe`` checkpoint is no family: it loads as the embedded model, whose GPTModel
(:mod:`replayrl.trainer.backends.megatron_model`) the backend always trains."""

# measured with megatron-core 0.16.1 on CPU (docs/design/megatron.md#megatron-families)
_GATED_DELTANET = (
    "its gated DeltaNet layers (megatron-core's GatedDeltaNet raises ImportError in its "
    "constructor without flash-linear-attention, the Triton kernel package `fla`, not installed; "
    "its torch path, deterministic_mode, still calls fla's l2norm; the hybrid block spec "
    "get_transformer_block_with_experimental_attention_variant_spec asserts transformer_impl "
    "'transformer_engine') with the model around them (the gated attention output, the gated "
    "shared expert, the weight conversion)")

NOT_YET = {
    "gpt_oss": "attention sinks, sliding-window layers and biased, clamped SwiGLU experts",
    "qwen3_5_moe": _GATED_DELTANET,
    "qwen3_5_moe_text": _GATED_DELTANET,
    "kimi_k25": "the text tower of a multimodal checkpoint (deepseek_v3 text, not loaded "
                "through the megatron conversion)",
    "deepseek_v4": "compressed sparse / heavily compressed attention and hash-routed MoE layers",
}
"""Family -> what of it the megatron backend does not build yet (the refusal names it)."""
