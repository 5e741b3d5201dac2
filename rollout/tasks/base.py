"""The Task interface: what a run trains on (docs/architecture.md "Where to add").

A task gives the rollout manager three things, and the manager knows nothing else of it:

* its prompts (:meth:`Task.prompts`): the training prompts, the prompts exact refill draws
  from, and the name errors give them, tokenised by the run's tokenizer;
* its reward (:meth:`Task.reward`): how one trajectory is scored, as a
  :class:`replayrl.rollout.scoring.rewards.RewardCall` the manager runs under its reward guard
  (``--custom-reward`` replaces it for every task); by default the configured ``--rm-type``
  (``rollout/tasks/rm_type.py``);
* its multi-turn environment (:meth:`Task.environment`), or ``None`` when it has none: a run
  with ``--rollout-max-turns > 1`` on such a task is refused before any process starts.

A task is built from the run's frozen :class:`replayrl.rollout.config.RolloutConfig` alone and
must be cheap to build: the run configuration builds one to check it before anything starts.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.scoring.rewards import RewardCall
from replayrl.rollout.tasks.environment import Environment
from replayrl.rollout.tasks.rm_type import rm_type_reward
from replayrl.rollout.text.data_source import Prompt

if TYPE_CHECKING:
    from replayrl.rollout.text.tokenizer import PromptTokenizer

__all__ = ["RewardCall", "Environment", "TaskPrompts", "Task"]


@dataclass(frozen=True)
class TaskPrompts:
    """A task's tokenised prompts.

    Attributes:
        train: the training prompts, in their dataset order (``index`` = position).
        replacement: the prompts exact refill draws from, in their own seeded order (may be
            ``train`` itself).
        name: how errors name these prompts (a file, ``"built-in digits"``).
    """

    train: list[Prompt]
    replacement: list[Prompt]
    name: str


class Task(ABC):
    """A task: its prompts, its reward and, optionally, its multi-turn environment.

    Adding one = a subclass in a module of ``rollout/tasks/`` plus one line in
    ``replayrl.rollout.tasks.TASKS``; ``--task NAME`` selects it.

    Args:
        config: the run's rollout settings.
    Raises:
        TaskConfigError: settings the task cannot run with (names the flags).
    """

    def __init__(self, config: RolloutConfig) -> None:
        self.config = config

    @abstractmethod
    def prompts(self, tokenizer: PromptTokenizer, *, vocab_size: int,
                max_prompt_len: int) -> TaskPrompts:
        """The task's prompts, tokenised by ``tokenizer``.

        Args:
            vocab_size: the policy's vocabulary; every prompt id must lie below it.
            max_prompt_len: the longest prompt that leaves room for a response.
        Raises:
            replayrl.rollout.text.prompt_data.PromptDataError: a prompt that cannot be used (names
                its row and the key).
        """

    def reward(self, tokenizer: PromptTokenizer, prompt: Prompt, response_ids: np.ndarray,
               loss_mask: np.ndarray) -> RewardCall:
        """How to score one trajectory: by default the configured ``--rm-type``
        (:func:`replayrl.rollout.tasks.rm_type.rm_type_reward`).

        Args:
            prompt: the trajectory's prompt (its ``label`` / ``answer_id`` are the reference).
            response_ids: int32 ``[R]``, read-only; observations included.
            loss_mask: uint8 ``[R]``, read-only; 0 on observation tokens.
        """
        return rm_type_reward(self.config.rm_type, tokenizer, prompt, response_ids, loss_mask)

    @classmethod
    def flag_defaults(cls, config: RolloutConfig) -> dict[str, Any]:
        """This task's own defaults of run flags: flag name (no dashes) -> value, for ``config``.

        The run configuration (``replayrl.tools.run.from_flags.build_config``) sets each flag left
        out of the command line and the config file to its value here; a flag that is given
        keeps its value (the task's constructor may refuse it). By default ``{}``: every flag
        has its global default.
        """
        return {}

    def environment(self) -> Environment | None:
        """The multi-turn environment (``observe`` on token ids,
        :class:`replayrl.rollout.tasks.environment.Environment`; the turn loop drives it through
        :class:`replayrl.rollout.tasks.environment.ObserveAdapter`, the ``--env`` API), or
        ``None`` (the default) when the task has none."""
        return None
