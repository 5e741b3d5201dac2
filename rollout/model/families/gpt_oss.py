"""gpt-oss (`gpt_oss`): attention sinks, alternating sliding-window / full attention, and a
biased linear router whose top-k logits are softmaxed into the expert weights; no indexer
(transformers' `GptOssForCausalLM`)."""

from replayrl.rollout.model.families.base import FamilySpec, softmax_topk_router_weights

FAMILY = FamilySpec(model_type="gpt_oss", router_attr="router",
                    router_weights=softmax_topk_router_weights, has_indexer=False)
