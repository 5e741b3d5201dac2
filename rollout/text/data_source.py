"""A seeded, epoch-based stream of prompts with a checkpointable cursor.

The prompts are fixed when the source is built (the run's task's: a prompt file, or the
built-in task's shipped prompts, ``rollout/tasks/``); each epoch visits them in a permutation drawn
from ``(seed, epoch)``. A request that crosses an epoch boundary is filled from the next epoch,
so every batch has exactly the size asked for. The state is only ``(epoch, cursor)``: a resumed
source produces the same next batch as an uninterrupted one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from replayrl.rollout.errors import DataExhausted


@dataclass(frozen=True)
class Prompt:
    """One prompt of the dataset.

    Attributes:
        index: position in the dataset (stable across epochs).
        prompt_ids: int32 [P], read-only.
        answer_id: token id of the label when the label is one token of the vocabulary (the
            embedded task's answer digit), else -1.
        label: the row's label as text (what ``--rm-type exact`` / ``math`` compare with).
        metadata: the row's metadata object, read-only.
        source: where the row came from, ``"FILE:LINE"`` (named in reward errors).
    """

    index: int
    prompt_ids: np.ndarray
    answer_id: int
    label: str = ""
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    source: str = ""


class PromptDataSource:
    """Seeded epochs over a fixed list of prompts.

    Args:
        prompts: the dataset (>= 1 prompt), in file order.
        seed: shuffling seed; epoch ``e`` is ``default_rng([seed, e]).permutation``.
        num_epoch: epochs that may be drawn; 0 = unbounded.
        name: named in :class:`DataExhausted` (e.g. the file).
    Raises:
        ValueError: no prompts, or a negative ``num_epoch``.
    """

    def __init__(self, prompts: Sequence[Prompt], seed: int, num_epoch: int = 0,
                 name: str = "prompt data") -> None:
        if not prompts:
            raise ValueError(f"{name}: no prompts")
        if num_epoch < 0:
            raise ValueError(f"num_epoch must be >= 0, got {num_epoch}")
        self.prompts = list(prompts)
        self.seed = seed
        self.num_epoch = num_epoch
        self.name = name
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts, continuing into the next epoch when this one runs out.

        Raises:
            ValueError: ``n < 0``.
            DataExhausted: the batch would need an epoch past ``num_epoch`` (the state is left
                as it was).
        """
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        remaining = (self.num_epoch - self.epoch) * len(self.prompts) - self.cursor
        if self.num_epoch and n > remaining:
            raise DataExhausted(f"{self.name}: --num-epoch {self.num_epoch} x {len(self.prompts)} "
                                f"prompts are drawn; {n} more asked for")
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
