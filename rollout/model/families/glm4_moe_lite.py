"""GLM-4.7-Flash (`glm4_moe_lite`): MLA attention over a MoE with sigmoid routing, a bias
correction and group-limited top-k; no indexer (transformers' `Glm4MoeLiteForCausalLM`)."""

from replayrl.rollout.model.families.base import FamilySpec, sigmoid_router_weights

FAMILY = FamilySpec(model_type="glm4_moe_lite", router_attr="gate",
                    router_weights=sigmoid_router_weights, has_indexer=False)
