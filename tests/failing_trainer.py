"""A TrainerActor whose second step raises: the whole run must stop with this traceback."""
from __future__ import annotations

from trainer.trainer_actor import TrainerActor


class FailingTrainer(TrainerActor):
    async def train(self, rollout_id: int) -> dict:
        if rollout_id == 1:
            raise RuntimeError("injected failure in step 1")
        return await super().train(rollout_id)


class FailBeforeUpdate(TrainerActor):
    """Dies after the preflight and before any optimizer work."""

    def _update(self, samples, token_accept, fused=False):
        raise RuntimeError("killed between preflight and update")
