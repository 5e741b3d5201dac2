"""The built-in digit task (``--task digits``, the default without ``--prompt-data``).

* Prompts: the digit puzzle's (``rollout/tasks/digit_puzzle.py``) ``dataset_size`` prompts
  (a rollout setting without a flag) drawn from ``--seed``, as text rows tokenised by the
  run's tokenizer like any prompt file.
  For the default settings (:data:`BUILTIN_SETTINGS`) they ship as ``rollout/data/digits.jsonl``
  (:data:`BUILTIN_FILE`, rows ``{"prompt": "<bos> max 3 1 4 2 =", "label": "4"}``); other
  settings draw them from the generator. Refill prompts are the dataset of ``seed + 7919``.
* Reward: the configured ``--rm-type`` (``digits`` by default: the puzzle's verifier).
* Environment: the calculator tool (``rollout/tasks/calculator.py``), used with
  ``--rollout-max-turns > 1``.

(docs/design/prompt-data.md#prompt-data.)
"""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.errors import TaskConfigError
from replayrl.rollout.tasks.base import Task, TaskPrompts
from replayrl.rollout.tasks.calculator import DigitToolEnv
from replayrl.rollout.tasks.digit_puzzle import DigitTask
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.text.prompt_data import PromptRow, read_rows, tokenize_rows

if TYPE_CHECKING:
    from replayrl.rollout.text.tokenizer import PromptTokenizer

__all__ = ["BUILTIN_FILE", "BUILTIN_SETTINGS", "REPLACEMENT_SEED_OFFSET", "digit_task_prompts",
           "digit_task_rows", "builtin_rows", "DigitsTask"]

BUILTIN_FILE = Path(__file__).resolve().parent.parent / "data" / "digits.jsonl"
BUILTIN_SETTINGS = {"seed": 1, "num_digits": 4, "num_values": 5, "dataset_size": 4096}
"""The settings whose embedded dataset :data:`BUILTIN_FILE` holds (the defaults)."""
REPLACEMENT_SEED_OFFSET = 7919
"""Replacement (refill) prompts come from their own seeded stream, ``seed + 7919``."""


def digit_task_prompts(task: DigitTask, seed: int, dataset_size: int) -> list[Prompt]:
    """The embedded task's ``dataset_size`` prompts drawn from ``seed`` as token ids.

    The reference the built-in prompt data is checked against (its rows are the text of these
    prompts, :func:`digit_task_rows`).

    Raises:
        ValueError: ``dataset_size < 1``.
    """
    if dataset_size < 1:
        raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
    rng = np.random.default_rng([seed, 0x5EED])
    prompts = []
    for i in range(dataset_size):
        ids, answer = task.make_prompt(rng)
        ids.flags.writeable = False
        prompts.append(Prompt(i, ids, answer, task.vocabulary[answer]))
    return prompts


def digit_task_rows(task: DigitTask, seed: int, dataset_size: int) -> list[dict[str, str]]:
    """The embedded task's prompts as text rows ``{"prompt", "label"}``: the same draws as
    :func:`digit_task_prompts`, written in the task's words."""
    return [{"prompt": task.decode(p.prompt_ids), "label": p.label}
            for p in digit_task_prompts(task, seed, dataset_size)]


def builtin_rows(config: RolloutConfig, seed: int) -> list[PromptRow]:
    """The built-in task's rows for ``seed``: the shipped file when the task settings are the
    ones it was made with (:data:`BUILTIN_SETTINGS`), else drawn from the task generator."""
    settings = {"seed": seed, "num_digits": config.num_digits, "num_values": config.num_values,
                "dataset_size": config.dataset_size}
    if settings == BUILTIN_SETTINGS:
        return read_rows(BUILTIN_FILE)
    task = DigitTask(num_digits=config.num_digits, num_values=config.num_values)
    return [PromptRow(f"digit task (seed {seed}):{i + 1}", r["prompt"], r["label"],
                      MappingProxyType({}))
            for i, r in enumerate(digit_task_rows(task, seed, config.dataset_size))]


class DigitsTask(Task):
    """The built-in digit task: shipped (or drawn) puzzle prompts, ``--rm-type``, calculator.

    Raises:
        TaskConfigError: ``--prompt-data`` is given (this task's prompts are built in).
        replayrl.rollout.tasks.digit_puzzle.TaskError: ``--num-digits`` / ``--num-values``
            outside the puzzle's range.
    """

    def __init__(self, config: RolloutConfig) -> None:
        super().__init__(config)
        if config.prompt_data:
            raise TaskConfigError(f"the digit task has its own prompts; --prompt-data "
                                  f"{config.prompt_data} is read by --task prompt_file")
        self.puzzle = DigitTask(num_digits=config.num_digits, num_values=config.num_values)
        self.calculator = DigitToolEnv(self.puzzle)

    def prompts(self, tokenizer: PromptTokenizer, *, vocab_size: int,
                max_prompt_len: int) -> TaskPrompts:
        """The dataset of ``--seed`` for training and of ``seed + 7919`` for refill
        (:func:`builtin_rows`), tokenised.

        Raises:
            replayrl.rollout.text.prompt_data.PromptDataError: as
                :func:`replayrl.rollout.text.prompt_data.tokenize_rows`.
        """
        cfg = self.config

        def tokens(seed: int) -> list[Prompt]:
            return tokenize_rows(builtin_rows(cfg, seed), tokenizer, input_key=cfg.input_key,
                                 vocab_size=vocab_size, max_prompt_len=max_prompt_len)

        return TaskPrompts(tokens(cfg.seed), tokens(cfg.seed + REPLACEMENT_SEED_OFFSET),
                           "built-in digits")

    def environment(self) -> DigitToolEnv:
        """The calculator tool over the puzzle's prompts."""
        return self.calculator
