"""config.json checks shared by the families whose config may be a multimodal composite
(`kimi_k25`, `qwen3_5_moe`) or carry multi-token-prediction layers (`deepseek_v3`,
`qwen3_5_moe_text`): what transformers' text modeling class does not run is refused, named."""

from __future__ import annotations

from typing import Any

from replayrl.rollout.model.errors import ModelConfigError


def refuse_unrun_fields(d: dict[str, Any], *, model_type: str, mtp_field: str) -> None:
    """Refuse a `quantization_config` inside `text_config`, and multi-token-prediction layers:
    `mtp_field` (of `text_config` when there is one, else of the top level) > 0. transformers'
    causal LM of these families builds no MTP layers (their weights are not loaded), so neither
    the engine nor the trainer would run what the checkpoint's MTP modules compute.

    Raises:
        ModelConfigError: naming the field (``text_config.<name>`` inside the composite).
    """
    text = d.get("text_config")
    scope, prefix = (text, "text_config.") if isinstance(text, dict) else (d, "")
    if scope.get("quantization_config") is not None:
        raise ModelConfigError(f"config.json field '{prefix}quantization_config' is not "
                               f"supported for model_type {model_type!r}")
    value = scope.get(mtp_field)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        raise ModelConfigError(
            f"config.json field '{prefix}{mtp_field}'={value!r}: multi-token-prediction layers "
            f"are not run by the {model_type!r} family model (set it to 0 to train the backbone "
            f"without them)")
