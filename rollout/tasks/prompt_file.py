"""The prompt-file task (``--task prompt_file``, the default with ``--prompt-data FILE``).

* Prompts: the rows of ``--prompt-data`` (JSONL or Parquet; ``--input-key``, ``--label-key``,
  ``--metadata-key``; ``rollout/text/prompt_data.py``), tokenised by the run's tokenizer; refill
  draws from the same prompts in their own seeded order.
* Reward: the configured ``--rm-type`` (``exact`` / ``math`` for text labels; ``digits`` for
  labels that are one vocabulary token) or ``--custom-reward``.
* Environment: none, so the run is single-turn (``--rollout-max-turns 1``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.errors import TaskConfigError
from replayrl.rollout.tasks.base import Task, TaskPrompts
from replayrl.rollout.text.prompt_data import read_rows, tokenize_rows

if TYPE_CHECKING:
    from replayrl.rollout.text.tokenizer import PromptTokenizer

__all__ = ["PromptFileTask"]


class PromptFileTask(Task):
    """Prompts from ``--prompt-data``, the ``--rm-type`` reward, no environment.

    Raises:
        TaskConfigError: no ``--prompt-data`` file given.
    """

    def __init__(self, config: RolloutConfig) -> None:
        super().__init__(config)
        if not config.prompt_data:
            raise TaskConfigError("the prompt-file task reads its prompts from --prompt-data "
                                  "FILE, and none is given")

    def prompts(self, tokenizer: PromptTokenizer, *, vocab_size: int,
                max_prompt_len: int) -> TaskPrompts:
        """Every row of ``--prompt-data``, checked and tokenised (also the refill prompts).

        Raises:
            replayrl.rollout.text.prompt_data.PromptDataError: see
                :func:`replayrl.rollout.text.prompt_data.read_rows` and ``tokenize_rows``.
        """
        cfg = self.config
        rows = read_rows(cfg.prompt_data, cfg.input_key, cfg.label_key, cfg.metadata_key)
        train = tokenize_rows(rows, tokenizer, input_key=cfg.input_key, vocab_size=vocab_size,
                              max_prompt_len=max_prompt_len)
        return TaskPrompts(train, train, cfg.prompt_data)
