"""Kimi K2.5 (`kimi_k25`): a vision tower and projector over a DeepSeek-V3 text tower
(`text_config.model_type` "deepseek_v3"). The family runs the text tower only: the checkpoint is
loaded by transformers' `Kimi_K25ForConditionalGeneration`, then its language model and LM head
become a `DeepseekV3ForCausalLM`; the vision weights are dropped, so image / video tokens are
ordinary embeddings, and `--save-hf` writes a `deepseek_v3` checkpoint."""

from replayrl.rollout.model.families.base import FamilySpec, sigmoid_router_weights
from replayrl.rollout.model.families.deepseek_v3 import DeepseekV3Model

FAMILY = FamilySpec(model_type="kimi_k25", router_attr="gate",
                    router_weights=sigmoid_router_weights, has_indexer=False,
                    model_class=DeepseekV3Model)
