"""The ``--lora-target-modules`` names and their check, without torch: the run settings are
checked in the launcher, which loads no torch (a torch runtime is ~200 MiB RSS:
VmRSS after ``import torch``, torch 2.13 CPU); the adapters themselves are
:mod:`replayrl.trainer.lora.peft_adapter` (peft, torch)."""
from __future__ import annotations

from replayrl.trainer.errors import TrainerConfigError

__all__ = ["ALL", "EMBEDDED_MODULES", "LORA_MODULES", "MLA_MODULES", "family_targets", "target_modules"]

ALL = "all"
"""The default ``--lora-target-modules``: every attention and MLP projection the policy has
(:func:`family_targets`), the router ``gate`` and ``lm_head`` left out."""
EMBEDDED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections of the embedded Qwen3-MoE (its experts' included, one ``nn.Linear`` each)."""
MLA_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
"""The low-rank query / key-value projections of MLA attention (the DeepSeek / GLM families)."""
DELTANET_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
"""The projections of Qwen3.5-MoE's gated DeltaNet layers (transformers' ``linear_attn``):
queries / keys / values, the output gate ``z``, the write strength ``b`` and the decay ``a``
(per value head), the output."""
V4_MODULES = ("kv_proj", "o_b_proj")
"""DeepSeek-V4's attention projections besides ``q_a_proj`` / ``q_b_proj``: the shared key-value
and the output mixing of its groups. Its per-group output block ``o_a_proj`` is not one: an
``nn.Linear`` subclass whose weight is applied block-diagonally per group, which peft's
``lora.Linear`` would apply as one dense matrix (the shapes do not even meet)."""
LORA_MODULES = (ALL, *EMBEDDED_MODULES, "gate", "lm_head", *MLA_MODULES, *DELTANET_MODULES, *V4_MODULES)
"""Names ``--lora-target-modules`` accepts (``all`` the default, ``gate`` the MoE router,
``lm_head`` the untied LM head)."""

_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_MLA = ("q_proj", *MLA_MODULES, "o_proj")  # q_proj: an MLA checkpoint without q_lora_rank
_FAMILY_MODULES = {
    "": EMBEDDED_MODULES,
    # the dense MLP and shared experts (gate_proj / up_proj / down_proj nn.Linear) are left out:
    # peft's loader reads those names as the fused experts on these model types (its conversion
    # of transformers 4 adapters), so an adapter on them would not load back
    **dict.fromkeys(("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "kimi_k25"), _MLA),
    "gpt_oss": ("q_proj", "k_proj", "v_proj", "o_proj"),
    **dict.fromkeys(("qwen3_5_moe", "qwen3_5_moe_text"),
                    ("q_proj", "k_proj", "v_proj", "o_proj", *DELTANET_MODULES, "gate_proj", "up_proj",
                     "down_proj")),
    # qualified: the compressors and the indexer have kv_proj / gate_proj / q_b_proj too
    "deepseek_v4": tuple(f"self_attn.{n}" for n in ("q_a_proj", "q_b_proj", *V4_MODULES))
    + tuple(f"shared_experts.{n}" for n in ("gate_proj", "up_proj", "down_proj")),
}
"""Per family (``""`` the embedded model): the projections peft adapts as ``nn.Linear``
modules, names as peft's ``target_modules`` (a module whose name ends with one)."""
_FUSED_EXPERTS = frozenset(_FAMILY_MODULES) - {"", "gpt_oss"}
"""Families whose routed experts are transformers' fused tensors ``mlp.experts.gate_up_proj``
[E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], adapted as peft ``target_parameters``
(gpt-oss's carry biases, which peft's parameter adapter does not handle)."""


def family_targets(names: tuple[str, ...], family: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``--lora-target-modules`` names -> ``(target_modules, target_parameters)`` of peft's
    ``LoraConfig`` for the policy of ``family`` (a family's HF ``model_type``, ``""`` the
    embedded model). ``all`` is every projection of the family's table; another name selects
    the table's entries of that name (``gate_proj`` / ``up_proj`` / ``down_proj`` also the fused
    expert tensors: ``gate_up_proj`` needs both of its projections); ``gate`` and ``lm_head`` pass
    through. The experts are given to peft as parameters directly, so peft's own renaming of
    transformers 4 expert names never runs: it would adapt ``gate_up_proj`` at rank 2r through a
    ``rank_pattern`` that its check then reports as matching nothing. Both tuples sorted.

    Raises:
        TrainerConfigError: ``gate_proj`` without ``up_proj`` (or the reverse) on fused experts,
            or no name that the family has (named).
    """
    table = _FAMILY_MODULES.get(family, _MLA)
    fused = family in _FUSED_EXPERTS
    want = set(names)
    if ALL in want:
        want |= {n.rsplit(".", 1)[-1] for n in table} | {"gate_proj", "up_proj", "down_proj"}
    modules = {n for n in table if n.rsplit(".", 1)[-1] in want} | (want & {"gate", "lm_head"})
    params = set()
    if fused:
        if len(want & {"gate_proj", "up_proj"}) == 1:
            raise TrainerConfigError(f"--lora-target-modules {','.join(names)}: the {family!r} family's experts "
                                     f"hold gate_proj and up_proj as one tensor (mlp.experts.gate_up_proj); "
                                     f"name both or neither")
        params = {p for p in _EXPERTS if want & ({"gate_proj", "up_proj"} if "gate_up" in p else {"down_proj"})}
    if not modules and not params:
        raise TrainerConfigError(f"--lora-target-modules {','.join(names)}: the {family or 'embedded'!r} "
                                 f"policy has none of these; its projections: "
                                 f"{', '.join(n.rsplit('.', 1)[-1] for n in table)}")
    return tuple(sorted(modules)), tuple(sorted(params))


def target_modules(spec: str) -> tuple[str, ...]:
    """``--lora-target-modules`` (comma list) -> its names, checked.

    Raises:
        TrainerConfigError: an empty list, or a name not in :data:`LORA_MODULES` (named).
    """
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in LORA_MODULES]
    if not names or unknown:
        raise TrainerConfigError(f"--lora-target-modules {spec!r}: expected a comma list of "
                                 f"{', '.join(LORA_MODULES)} (all = every attention and MLP projection of "
                                 f"the policy, gate = the MoE router, lm_head = the LM head), got "
                                 f"{unknown or 'nothing'}")
    return names
