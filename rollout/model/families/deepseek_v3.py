"""DeepSeek-V3 (`deepseek_v3`): MLA attention over a MoE with shared experts and sigmoid routing
with a bias correction and group-limited top-k; no indexer (transformers'
`DeepseekV3ForCausalLM`). Multi-token-prediction layers (`num_nextn_predict_layers` > 0) are
refused: transformers' model does not build them."""

from typing import Any

from replayrl.rollout.model.families.base import FamilyModel, FamilySpec, sigmoid_router_weights
from replayrl.rollout.model.families.text_checks import refuse_unrun_fields


class DeepseekV3Model(FamilyModel):
    """:class:`FamilyModel` of DeepSeek-V3 and of Kimi K2.5's text tower (its `text_config` is
    `deepseek_v3`), refusing the config.json fields it does not run."""

    @staticmethod
    def check_hf_dict(d: dict[str, Any]) -> None:
        """Refuse `num_nextn_predict_layers` > 0 and a `text_config.quantization_config`;
        raises `ModelConfigError` naming the field."""
        refuse_unrun_fields(d, model_type=str(d.get("model_type")),
                            mtp_field="num_nextn_predict_layers")


FAMILY = FamilySpec(model_type="deepseek_v3", router_attr="gate",
                    router_weights=sigmoid_router_weights, has_indexer=False,
                    model_class=DeepseekV3Model)
