"""A TrainerActor whose RS gate rejects everything on even rollouts and accepts everything on odd
ones, so a real run alternates skipped and trained steps deterministically."""
from __future__ import annotations

from replayrl.trainer.ranks.trainer_actor import TrainerActor
from replayrl.trainer.rejection.rs_policy import RSGate

REJECT_ALL = RSGate("geometric", 1e30, 1e30)  # a ratio of 1e30 needs a sampled logprob < -69
ACCEPT_ALL = RSGate("geometric", 1e-30, 1e30)


class SkipEvenSteps(TrainerActor):
    async def train(self, rollout_id: int) -> dict:
        self.gate = REJECT_ALL if rollout_id % 2 == 0 else ACCEPT_ALL
        return await super().train(rollout_id)
