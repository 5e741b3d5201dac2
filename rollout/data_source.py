"""A seeded, epoch-based source of prompts with a checkpointable cursor.

The dataset is ``dataset_size`` prompts drawn once from ``seed``; each epoch visits them in a
permutation drawn from ``(seed, epoch)``. A request that crosses an epoch boundary is filled
from the next epoch, so every batch has exactly the size asked for. The state is only
``(epoch, cursor)``: a resumed source produces the same next batch as an uninterrupted one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollout.task import DigitTask


@dataclass(frozen=True)
class Prompt:
    """One prompt of the dataset.

    Attributes:
        index: position in the dataset (stable across epochs).
        prompt_ids: int32 [P], read-only.
        answer_id: token id of the correct answer (the verifier's label).
    """

    index: int
    prompt_ids: np.ndarray
    answer_id: int


class PromptDataSource:
    """Seeded prompts for the embedded task.

    Args:
        task: the task that makes prompts.
        seed: dataset and shuffling seed.
        dataset_size: number of distinct prompts (>= 1).
    Raises:
        ValueError: ``dataset_size < 1`` or a negative batch size.
    """

    def __init__(self, task: DigitTask, seed: int, dataset_size: int = 4096) -> None:
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
        rng = np.random.default_rng([seed, 0x5EED])
        self.seed = seed
        self.prompts: list[Prompt] = []
        for i in range(dataset_size):
            ids, answer = task.make_prompt(rng)
            ids.flags.writeable = False
            self.prompts.append(Prompt(i, ids, answer))
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts, continuing into the next epoch when this one runs out."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        batch = []
        while len(batch) < n:
            if self.cursor == len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(batch), len(self._order) - self.cursor)
            batch += [self.prompts[i] for i in self._order[self.cursor:self.cursor + take]]
            self.cursor += take
        return batch

    def state_dict(self) -> dict:
        """``{"epoch", "cursor"}``: everything needed to resume."""
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`."""
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)
