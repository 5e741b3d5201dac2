"""What the torch backend (:mod:`replayrl.trainer.backends.torch_backend`) refuses of a run's
settings, checked before any process starts; light (no torch), as the launcher that checks it."""
from __future__ import annotations

from typing import Any

from replayrl.rollout.model.families.run_check import family_of
from replayrl.trainer.errors import TrainerConfigError


def check_run(run: Any) -> None:
    """Refuse several ranks on a family policy: the backend's DDP is not checked on transformers'
    models; FSDP2 shards them (docs/trainer-ranks.md#fsdp).

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read:
            ``policy_config``, ``trainer.dp_size`` and ``trainer.train_backend``.
    Raises:
        TrainerConfigError: ``--dp-size`` above 1 with a family policy (names ``--train-backend
            fsdp``).
    """
    family = family_of(run.policy_config)
    if family and run.trainer.dp_size != 1:
        raise TrainerConfigError(f"--dp-size {run.trainer.dp_size}: the {family!r} family trains on one rank "
                                 f"with --train-backend {run.trainer.train_backend}; use --train-backend fsdp")
