"""Which ``--lora-target-modules`` the run's policy has, checked before any process starts;
light (no peft, no torch), as the launcher that checks it. The adapters themselves are
:mod:`replayrl.trainer.lora.peft_adapter`."""
from __future__ import annotations

from typing import Any

from replayrl.rollout.model.families.run_check import family_of
from replayrl.trainer.errors import TrainerConfigError
from replayrl.trainer.lora.settings import ALL, EMBEDDED_MODULES, family_targets, target_modules


def check_run(run: Any) -> None:
    """Refuse LoRA targets the policy has no adaptable module for; a run without
    ``--lora-rank`` passes.

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read:
            ``trainer.lora_rank``, ``trainer.lora_target_modules``, ``policy_config`` and
            ``hf_checkpoint``.
    Raises:
        TrainerConfigError: ``gate`` on a family policy (its router is transformers' own top-k
            module, not an ``nn.Linear``); on a family, names it has none of or one half of
            its fused experts' ``gate_up_proj`` (``family_targets``); a family's projections
            (MLA, DeltaNet, DeepSeek-V4) on the embedded model (which has
            :data:`EMBEDDED_MODULES`); ``lm_head`` on a policy whose LM head is tied to its
            embedding (the engine merges ``W + B A`` into the weight in place, which would
            change the embedding the trainer's adapter leaves alone).
    """
    if not run.trainer.lora_rank:
        return
    targets = target_modules(run.trainer.lora_target_modules)
    family = family_of(run.policy_config)
    if family and "gate" in targets:
        raise TrainerConfigError(f"--lora-target-modules gate with the {family!r} family of --hf-checkpoint "
                                 f"{run.hf_checkpoint}: its router (mlp.gate) is transformers' own top-k module, "
                                 f"not an nn.Linear; peft cannot adapt it (docs/design/lora.md#lora)")
    if family:  # names the family has none of, gate_proj without up_proj on fused experts
        family_targets(targets, family)
    foreign = sorted(set(targets) - {ALL, "gate", "lm_head", *EMBEDDED_MODULES})
    if not family and foreign:
        raise TrainerConfigError(f"--lora-target-modules {','.join(foreign)}: projections of the --hf-checkpoint "
                                 f"families; the embedded Qwen3-MoE has {' / '.join(EMBEDDED_MODULES)}")
    if "lm_head" in targets and getattr(run.policy_config, "tie_word_embeddings", False):
        raise TrainerConfigError("--lora-target-modules lm_head: the policy's LM head is tied to its embedding "
                                 "(config.json field 'tie_word_embeddings'=true); an adapter on it would "
                                 "change the embedding too. Leave lm_head out of --lora-target-modules")
