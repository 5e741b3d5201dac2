"""DeepSeek-V3.2 (`deepseek_v32`): MLA, shared experts, sigmoid routing with a bias correction
and group-limited top-k, and the DSA lightning indexer on every layer (transformers'
`DeepseekV32ForCausalLM`)."""

from replayrl.rollout.model.families.base import FamilySpec, sigmoid_router_weights

FAMILY = FamilySpec(model_type="deepseek_v32", router_attr="gate",
                    router_weights=sigmoid_router_weights, has_indexer=True)
