"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's MLA / sigmoid-routed MoE / DSA indexer with the
indexer's interleaved RoPE; layers of `indexer_types` "shared" reuse the previous "full" layer's
top-k, so only "full" layers are indexed layers (stored once, replayed to the sharing layers by
transformers' own propagation). transformers' `GlmMoeDsaForCausalLM`."""

from replayrl.rollout.model.families.base import FamilySpec, sigmoid_router_weights

FAMILY = FamilySpec(model_type="glm_moe_dsa", router_attr="gate",
                    router_weights=sigmoid_router_weights, has_indexer=True)
