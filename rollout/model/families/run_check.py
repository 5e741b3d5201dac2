"""What the family room refuses of a run's settings, checked before any process starts.

Light on purpose (no torch, no transformers): the launcher checks the run's settings and loads
neither (docs/benchmarks.md, memory). A family's model is transformers' own modeling class
(:mod:`replayrl.rollout.model.families.base`), so settings that need the embedded model's own
code paths are refused here, naming the flag.
"""
from __future__ import annotations

from typing import Any

from replayrl.rollout.model.errors import ModelConfigError


def family_of(model_config: Any) -> str:
    """The family (HF ``model_type`` of the family room) of a policy's shape, or ``""`` for the
    embedded Qwen3 / Qwen3-MoE model.

    Args:
        model_config: a ``ModelConfig`` (no family) or a family room ``FamilyConfig``.
    """
    return getattr(model_config, "family", "")


def check_run(run: Any) -> None:
    """Refuse the settings a family model cannot train with; accepts every run of the embedded
    model.

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read:
            ``policy_config`` and ``trainer.use_packing``.
    Raises:
        ModelConfigError: ``--use-packing`` with a family policy (its model has no packed
            segments).
    """
    family = family_of(run.policy_config)
    if family and run.trainer.use_packing:
        raise ModelConfigError(f"--use-packing: the {family!r} family model has no packed segments")
