"""What the backend room refuses of a run's settings, before any process starts.

A backend with settings of its own to refuse has a light module beside it (no backend import:
the launcher that checks the run loads no torch for the torch and FSDP backends) with
``check_run(run)``, named in :data:`RUN_CHECKS`; a backend not named there accepts every
setting. A policy of the family room (transformers' model, rollout/model/families/) is trained
only by the backends of :data:`FAMILY_BACKENDS`.
"""
from __future__ import annotations

from typing import Any, Callable

from replayrl.rollout.model.families.run_check import family_of
from replayrl.trainer.backends import megatron_run_check, torch_run_check
from replayrl.trainer.errors import TrainerConfigError

RUN_CHECKS: dict[str, Callable[[Any], None]] = {
    "torch": torch_run_check.check_run,
    "megatron": megatron_run_check.check_run,
}
"""Backend registry name -> its check of the run's settings (raises TrainerConfigError)."""

FAMILY_BACKENDS = ("torch", "fsdp", "megatron")
"""The backends that train a family room policy (transformers' model as a torch module; the
megatron backend some families, refusing the others in its own check,
:func:`replayrl.trainer.backends.megatron_run_check.check_family`)."""


def check_run(run: Any) -> None:
    """The run's backend (``--train-backend``) checks the settings it cannot train with: a
    family policy (:data:`FAMILY_BACKENDS`), then its own check (:data:`RUN_CHECKS`).

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read:
            ``trainer.train_backend``, ``policy_config``, ``hf_checkpoint``, and what each
            backend's check reads.
    Raises:
        TrainerConfigError: a setting the backend refuses (the message names the flags).
    """
    backend = run.trainer.train_backend
    family = family_of(run.policy_config)
    if family and backend not in FAMILY_BACKENDS:
        raise TrainerConfigError(f"--train-backend {backend} cannot train the {family!r} family of "
                                 f"--hf-checkpoint {run.hf_checkpoint} (config.json field 'model_type'); "
                                 f"use --train-backend {' or '.join(FAMILY_BACKENDS)}")
    if backend in RUN_CHECKS:
        RUN_CHECKS[backend](run)
