"""Qwen3.5-MoE (`qwen3_5_moe`, and its text model `qwen3_5_moe_text`): three of every four layers
gated DeltaNet (linear attention: a causal convolution and a recurrent state), the rest full
attention, every layer a softmax top-k MoE with a gated shared expert (transformers'
`Qwen3_5MoeForCausalLM`). Of the multimodal `qwen3_5_moe` checkpoint the text tower runs (loaded
through `Qwen3_5MoeForConditionalGeneration`, the vision weights dropped; `--save-hf` writes a
`qwen3_5_moe_text` checkpoint).

The engine's cache is transformers' `DynamicCache`: per DeltaNet layer its convolution state
`[B, conv_dim, kernel]` and recurrent state `[B, heads_v, d_k, d_v]`, per attention layer keys
and values; `reorder_cache` selects rows of all of them. A left-padded prompt is exact: padding
inputs are zeroed, so the convolution and the recurrent state see nothing before the prompt.
Multi-token-prediction layers (`mtp_num_hidden_layers` > 0) are refused: transformers' model does
not build them, and their routers are not the backbone's.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replayrl.rollout.model.families.base import FamilyModel, FamilySpec
from replayrl.rollout.model.families.text_checks import refuse_unrun_fields


def softmax_renormalised_router_weights(router: nn.Module, logits: torch.Tensor,
                                        experts: torch.Tensor) -> torch.Tensor:
    """Routing weights of `experts` (int64 `[N, K]`) from router logits `[N, E]`, as
    transformers' `Qwen3_5MoeTopKRouter`: softmax over all experts in float32, gathered, divided
    by their sum (it always renormalises; the config has no `norm_topk_prob`); float32 `[N, K]`."""
    w = F.softmax(logits, dim=-1, dtype=torch.float32).gather(1, experts)
    return w / w.sum(dim=-1, keepdim=True)


class Qwen35MoeModel(FamilyModel):
    """:class:`FamilyModel` of Qwen3.5-MoE: DeltaNet layers have no `self_attn` (and no layer
    has an indexer); refuses the config.json fields it does not run."""

    @staticmethod
    def indexer_of(layer: nn.Module) -> nn.Module | None:
        """None: Qwen3.5-MoE has no sparse-attention indexer."""
        return None

    @staticmethod
    def check_hf_dict(d: dict[str, Any]) -> None:
        """Refuse `mtp_num_hidden_layers` > 0 and a `text_config.quantization_config`; raises
        `ModelConfigError` naming the field."""
        refuse_unrun_fields(d, model_type=str(d.get("model_type")),
                            mtp_field="mtp_num_hidden_layers")


FAMILY = FamilySpec(model_type="qwen3_5_moe", router_attr="gate",
                    router_weights=softmax_renormalised_router_weights, has_indexer=False,
                    model_class=Qwen35MoeModel)
TEXT_FAMILY = FamilySpec(model_type="qwen3_5_moe_text", router_attr="gate",
                         router_weights=softmax_renormalised_router_weights, has_indexer=False,
                         model_class=Qwen35MoeModel)
