"""The family room: model families that `--hf-checkpoint` reads besides `qwen3` / `qwen3_moe`.

One file per family and one line in :data:`FAMILIES` (HF ``model_type`` -> ``"module:attribute"``
of its :class:`replayrl.rollout.model.families.base.FamilySpec`). A family's model is
transformers' own modeling class, wrapped by
:class:`replayrl.rollout.model.families.base.FamilyModel` with trace capture and replay at the
MoE routers and the sparse-attention indexers (docs/architecture.md, "A model family").
``qwen3`` / ``qwen3_moe`` stay on the embedded model (rollout/model/qwen3_moe.py).
"""

from __future__ import annotations

from replayrl.actors.registry import LazyRegistry
from replayrl.rollout.model.errors import ModelConfigError

FAMILIES = LazyRegistry(
    {
        "deepseek_v3": "replayrl.rollout.model.families.deepseek_v3:FAMILY",
        "deepseek_v32": "replayrl.rollout.model.families.deepseek_v32:FAMILY",
        "deepseek_v4": "replayrl.rollout.model.families.deepseek_v4:FAMILY",
        "glm_moe_dsa": "replayrl.rollout.model.families.glm_moe_dsa:FAMILY",
        "glm4_moe_lite": "replayrl.rollout.model.families.glm4_moe_lite:FAMILY",
        "gpt_oss": "replayrl.rollout.model.families.gpt_oss:FAMILY",
        "kimi_k25": "replayrl.rollout.model.families.kimi_k25:FAMILY",
        "qwen3_5_moe": "replayrl.rollout.model.families.qwen3_5_moe:FAMILY",
        "qwen3_5_moe_text": "replayrl.rollout.model.families.qwen3_5_moe:TEXT_FAMILY",
    },
    unknown=lambda name, known: ModelConfigError(f"config.json field 'model_type'={name!r} is no "
                                                 f"registered family (known: {known})"),
    invalid=lambda name, why: ModelConfigError(f"config.json field 'model_type'={name!r}: "
                                               f"family {why}"))


def is_family(model_type: object) -> bool:
    """True when ``model_type`` (config.json field) is served by the family room."""
    return isinstance(model_type, str) and model_type in FAMILIES


def family_spec(model_type: str):
    """The :class:`FamilySpec` registered for ``model_type``, imported on this call.

    Raises ``ModelConfigError`` naming the field ``model_type`` for an unregistered one (or
    one whose module cannot be imported).
    """
    return FAMILIES.resolve(model_type)
