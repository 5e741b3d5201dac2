"""The built-in sort task (``--task sort``): long verifiable answers, trainable on CPU.

* Prompts: ``<bos> d1 d2 ... dN =``, N = ``--answer-tokens`` digits drawn uniformly from
  ``0 .. --num-values - 1``; ``dataset_size`` of them (a rollout setting without a flag) drawn
  from ``--seed`` (:func:`sort_rows`), as text rows tokenised by the run's tokenizer like any prompt file (the
  embedded tokenizer's words: one digit = one token). Refill prompts are the dataset of
  ``seed + 7919`` (:data:`replayrl.rollout.tasks.digits.REPLACEMENT_SEED_OFFSET`).
* Answer: the prompt's N digits in ascending order, then EOS: N + 1 new tokens. The row's label
  is the N digits as text (``"0 1 1 3"``); ``--rollout-max-response-len`` defaults to N + 1 for
  this task and a smaller one is refused.
* The task's own flag defaults (:meth:`SortTask.flag_defaults`): that response length and
  ``--grpo-std-normalization``; the global defaults are unchanged.
* Reward: :func:`position_reward`, the fraction of the N + 1 answer positions right.
* Environment: none (single turn).

(docs/design/prompt-data.md#sort-task.)
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.errors import PromptDataError, TaskConfigError
from replayrl.rollout.tasks.base import RewardCall, Task, TaskPrompts
from replayrl.rollout.tasks.calculator import DigitToolEnv
from replayrl.rollout.tasks.digits import REPLACEMENT_SEED_OFFSET
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.text.prompt_data import PromptRow, tokenize_rows

if TYPE_CHECKING:
    from replayrl.rollout.text.tokenizer import PromptTokenizer

__all__ = ["SORT_STREAM", "prompt_tokens", "sort_rows", "position_reward", "SortTask"]

SORT_STREAM = 0x5027
"""The sort task's prompts for seed ``s`` are drawn from ``np.random.default_rng([s, 0x5027])``
(a stream of its own: the digit task's is ``[s, 0x5EED]``)."""

_FINAL = DigitToolEnv()  # final_answer only: the tokens after the last observation token


def prompt_tokens(answer_tokens: int) -> int:
    """Tokens in one sort prompt of ``answer_tokens`` digits: ``<bos>``, the digits, ``=``."""
    return answer_tokens + 2


def sort_rows(seed: int, answer_tokens: int, num_values: int, dataset_size: int) -> list[PromptRow]:
    """The sort task's ``dataset_size`` prompt rows drawn from ``seed``.

    Row ``i``'s prompt is ``"<bos> d1 ... dN ="`` and its label the same N digits sorted
    ascending, space-separated (``"0 1 1 3"``); digits are uniform over ``0 .. num_values - 1``.
    The source of row ``i`` is ``"sort task (seed S):i+1"``.

    Raises:
        TaskConfigError: ``answer_tokens < 1``, ``num_values`` outside ``[2, 10]`` or
            ``dataset_size < 1`` (names the setting).
    """
    if answer_tokens < 1:
        raise TaskConfigError(f"--answer-tokens must be >= 1, got {answer_tokens}")
    if not 2 <= num_values <= 10:
        raise TaskConfigError(f"--num-values must be in [2, 10] for the sort task, got {num_values}")
    if dataset_size < 1:
        raise TaskConfigError(f"dataset_size must be >= 1, got {dataset_size}")
    rng = np.random.default_rng([seed, SORT_STREAM])
    digits = rng.integers(0, num_values, size=(dataset_size, answer_tokens))
    rows = []
    for i, row in enumerate(digits):
        prompt = "<bos> " + " ".join(str(int(d)) for d in row) + " ="
        label = " ".join(str(int(d)) for d in np.sort(row))
        rows.append(PromptRow(f"sort task (seed {seed}):{i + 1}", prompt, label, MappingProxyType({})))
    return rows


def position_reward(response_ids: np.ndarray, expected_ids: np.ndarray,
                    eos_ids: tuple[int, ...]) -> float:
    """Partial credit per answer position, in [0, 1].

    With ``expected_ids`` the N answer digits' token ids, the answer has ``L = N + 1``
    positions: the N digits, then EOS (any id of ``eos_ids``). The reward is::

        (1 / L) * #{ i < L : i < len(response) and response[i] == answer[i] }

    A response shorter than L gets no credit for its missing positions (an early EOS is wrong
    at its own position and leaves the rest missing); tokens past position L - 1 are not scored,
    but a response that has them did not stop at position N, so its EOS position is wrong.
    Example: answer ``1 2 3 <eos>`` (L = 4), response ``1 3 3 <eos>`` scores 3 / 4, response
    ``1 2 <eos>`` scores 2 / 4.

    Args:
        response_ids: int ``[R]``, the final segment of the response.
        expected_ids: int ``[N]``, N >= 1.
        eos_ids: the ids that end a response (non-empty).
    Raises:
        TaskConfigError: ``expected_ids`` or ``eos_ids`` empty.
    """
    n = len(expected_ids)
    if n == 0 or not eos_ids:
        raise TaskConfigError("position_reward needs at least one answer digit and one EOS id")
    response = np.asarray(response_ids, dtype=np.int64)
    k = min(len(response), n)
    right = int(np.count_nonzero(response[:k] == np.asarray(expected_ids, dtype=np.int64)[:k]))
    if len(response) > n and int(response[n]) in eos_ids:
        right += 1
    return right / (n + 1)


class SortTask(Task):
    """The sort task: prompts of ``--answer-tokens`` digits, answered sorted then EOS.

    Raises:
        TaskConfigError: ``--prompt-data`` is given (this task's prompts are built in), or
            ``--rollout-max-response-len`` < ``--answer-tokens`` + 1 (names both flags).
    """

    def __init__(self, config: RolloutConfig) -> None:
        super().__init__(config)
        if config.prompt_data:
            raise TaskConfigError(f"the sort task has its own prompts; --prompt-data "
                                  f"{config.prompt_data} is read by --task prompt_file")
        need = self.response_tokens(config)
        if config.max_response_len < need:
            raise TaskConfigError(f"--rollout-max-response-len {config.max_response_len} cannot "
                                  f"hold the answer of --answer-tokens {config.answer_tokens}: "
                                  f"{need} tokens (the digits and EOS); give at least {need} or "
                                  f"leave it out (it then defaults to {need} for this task)")
        self._digit_ids: dict[str, int] | None = None

    @classmethod
    def flag_defaults(cls, config: RolloutConfig) -> dict[str, Any]:
        """The sort task's own defaults, for flags left out (:meth:`Task.flag_defaults`):

        * ``rollout-max-response-len``: :meth:`response_tokens`, the answer's N + 1 tokens;
        * ``grpo-std-normalization``: on. The reward is a mean over N + 1 positions, so within
          a group it varies by about ``1 / sqrt(N + 1)`` of a two-token answer's spread; an
          advantage that is not divided by the group's std is then swamped by the per-token
          entropy bonus ``-beta log pi`` (``--entropy-coef``), whose size does not shrink with
          N, and the policy stays at its initial entropy (docs/design/prompt-data.md#sort-task).
        """
        return {"rollout-max-response-len": cls.response_tokens(config), "grpo-std-normalization": True}

    @classmethod
    def response_tokens(cls, config: RolloutConfig) -> int:
        """New tokens one answer takes: ``--answer-tokens`` digits plus EOS (the default of
        ``--rollout-max-response-len`` for this task)."""
        return config.answer_tokens + 1

    def _digits_of(self, tokenizer: PromptTokenizer) -> dict[str, int]:
        """Digit text -> its token id in ``tokenizer`` (cached after the first call).

        Raises:
            PromptDataError: a digit that is not one token of the tokenizer's vocabulary.
        """
        if self._digit_ids is None:
            vocab = tokenizer.tokenizer.get_vocab()
            missing = [str(d) for d in range(10) if str(d) not in vocab]
            if missing:
                raise PromptDataError(f"built-in sort: tokenizer {tokenizer.directory} has no "
                                      f"token for the digits {missing} (the sort task's answers "
                                      f"are one token per digit)")
            self._digit_ids = {str(d): int(vocab[str(d)]) for d in range(10)}
        return self._digit_ids

    def prompts(self, tokenizer: PromptTokenizer, *, vocab_size: int,
                max_prompt_len: int) -> TaskPrompts:
        """The dataset of ``--seed`` for training and of ``seed + 7919`` for refill
        (:func:`sort_rows`), tokenised.

        Raises:
            replayrl.rollout.text.prompt_data.PromptDataError: as
                :func:`replayrl.rollout.text.prompt_data.tokenize_rows`, or a tokenizer without one
                token per digit.
        """
        cfg = self.config
        self._digits_of(tokenizer)

        def tokens(seed: int) -> list[Prompt]:
            rows = sort_rows(seed, cfg.answer_tokens, cfg.num_values, cfg.dataset_size)
            return tokenize_rows(rows, tokenizer, input_key=cfg.input_key, vocab_size=vocab_size,
                                 max_prompt_len=max_prompt_len)

        return TaskPrompts(tokens(cfg.seed), tokens(cfg.seed + REPLACEMENT_SEED_OFFSET), "built-in sort")

    def reward(self, tokenizer: PromptTokenizer, prompt: Prompt, response_ids: np.ndarray,
               loss_mask: np.ndarray) -> RewardCall:
        """:func:`position_reward` of the final segment against the prompt's label (its digits'
        token ids) and the tokenizer's EOS ids, inline (bounded by the response length).

        Raises:
            replayrl.rollout.tasks.calculator.ToolEnvError: ``response_ids`` and ``loss_mask``
                differ in length.
            PromptDataError: as :meth:`_digits_of`.
        """
        digits = self._digits_of(tokenizer)
        expected = np.asarray([digits[d] for d in prompt.label.split()], dtype=np.int64)
        return RewardCall(position_reward, (_FINAL.final_answer(response_ids, loss_mask), expected,
                                            tuple(tokenizer.eos_token_ids)), bounded=True)
