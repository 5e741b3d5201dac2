"""The ``--lora-target-modules`` names and their check, without torch: the run settings are
checked in the launcher, which loads no torch (a torch runtime is ~200 MiB RSS:
VmRSS after ``import torch``, torch 2.13 CPU); the adapters themselves are
:mod:`replayrl.trainer.lora.peft_adapter` (peft, torch)."""
from __future__ import annotations

from replayrl.trainer.errors import TrainerConfigError

__all__ = ["LORA_MODULES", "MLA_MODULES", "target_modules"]

MLA_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
"""The low-rank query / key-value projections of MLA attention (the DeepSeek / GLM families)."""
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate",
                "lm_head", *MLA_MODULES)
"""Module names ``--lora-target-modules`` accepts (``gate`` is the MoE router, ``lm_head`` the
untied LM head)."""


def target_modules(spec: str) -> tuple[str, ...]:
    """``--lora-target-modules`` (comma list) -> its names, checked.

    Raises:
        TrainerConfigError: an empty list, or a name not in :data:`LORA_MODULES` (named).
    """
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in LORA_MODULES]
    if not names or unknown:
        raise TrainerConfigError(f"--lora-target-modules {spec!r}: expected a comma list of "
                                 f"{', '.join(LORA_MODULES)} (gate = the MoE router, lm_head = the LM head), got "
                                 f"{unknown or 'nothing'}")
    return names
