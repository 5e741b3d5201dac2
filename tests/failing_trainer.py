"""A TrainerActor whose second step raises: the whole run must stop with this traceback."""
from __future__ import annotations

import os
from pathlib import Path

from replayrl.trainer.ranks.trainer_actor import TrainerActor


class FailingTrainer(TrainerActor):
    async def train(self, rollout_id: int) -> dict:
        if rollout_id == 1:
            raise RuntimeError("injected failure in step 1")
        return await super().train(rollout_id)


class FailBeforeUpdate(TrainerActor):
    """Dies after the preflight and before any optimizer work."""

    def _update(self, samples, token_accept, fused=False):
        raise RuntimeError("killed between preflight and update")


class DiesWhileSaving(TrainerActor):
    """Its process dies (exit 9) halfway through writing its second checkpoint: the model is
    written, the optimizer state is not."""

    saves = 0

    async def save_checkpoint(self, directory: str) -> str:
        type(self).saves += 1
        if type(self).saves == 2:
            from replayrl.rollout.model.checkpoint import save_pretrained

            save_pretrained(self.backend.model, Path(directory) / "model", tokens=self.backend.vocab_tokens)
            os._exit(9)
        return await super().save_checkpoint(directory)
