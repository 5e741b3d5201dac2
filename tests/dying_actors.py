"""Actors that lose their own process at a known point of a run (real signals, no mocks):
the run must end cleanly with that actor's ActorDied and its last checkpoint intact."""
from __future__ import annotations

import dataclasses
import os
import signal

from actors.version_clock import VersionClock
from rollout.manager import RolloutManager
from trainer.trainer_actor import TrainerActor


class StoppedTrainer(TrainerActor):
    """Freezes its process (SIGSTOP) at the start of step 1: alive, but silent."""

    async def train(self, rollout_id: int) -> dict:
        if rollout_id == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        return await super().train(rollout_id)


class KilledClock(VersionClock):
    """SIGKILLs its process when step 1 records trainer version 2 (after the step-1 checkpoint)."""

    async def set_trainer_version(self, version: int) -> int:
        if version == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return await super().set_trainer_version(version)


class KilledManager(RolloutManager):
    """SIGKILLs its process when asked for rollout 2 (after the step-1 checkpoint)."""

    async def generate(self, rollout_id: int, min_version: int | None = None) -> dict:
        if rollout_id == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return await super().generate(rollout_id, min_version)


def stopped_trainer_specs(specs):
    """``specs`` with the trainer replaced by :class:`StoppedTrainer`."""
    return [dataclasses.replace(s, cls=f"{__name__}:StoppedTrainer") if s.name == "trainer"
            else s for s in specs]


def killed_after_first_checkpoint(specs, actor: str):
    """``specs`` with ``actor`` (``version_clock`` or ``rollout_manager``) replaced by the
    class above that kills itself during step 1."""
    cls = {"version_clock": "KilledClock", "rollout_manager": "KilledManager"}[actor]
    return [dataclasses.replace(s, cls=f"{__name__}:{cls}") if s.name == actor else s
            for s in specs]
