"""A tiny tool environment on the embedded digit task, for multi-turn rollouts.

The task (``rollout/tasks/digit_puzzle.py``): prompt ``<bos> op d1 .. dn =``, answer one digit then ``<eos>``.
The tool is a calculator over the prompt's digits, spoken in the task's own vocabulary so the
embedded model needs no new tokens:

* a turn whose **first token is an operator** (``max`` / ``min`` / ``first`` / ``last``) is a
  tool call, whatever follows it in that turn;
* the environment answers with the observation ``= d``: the tokens ``=`` and the digit that
  operator gives on the prompt's digits (the same definitions as the task's answers), so
  calling the operator the prompt asks for reveals the answer;
* any other turn is the final answer; the episode ends there.

The observation ends with the answer digit after ``=``, the same shape as the prompt's end, so a
policy can learn to call the right operator and copy the hint. Observation tokens are not
sampled by the policy: the multi-turn generator gives them loss_mask 0 and ``-1`` support rows
(``rollout/episodes/turn_loop.py``).

Reward (verifiable from the tokens alone): the task's reward of the *final segment*, the tokens
after the last observation token; a trajectory whose last turn is a tool call scores 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from replayrl.rollout.errors import ToolEnvError
from replayrl.rollout.tasks.digit_puzzle import DIGITS, OPERATORS, VOCABULARY, DigitTask
from replayrl.rollout.tasks.environment import ObserveAdapter

__all__ = ["DigitToolEnv", "DigitCalculatorEnv"]

_OPERATOR_IDS = {VOCABULARY.index(op): op for op in OPERATORS}
_DIGIT_IDS = {VOCABULARY.index(d): int(d) for d in DIGITS}
_EQUALS_ID = VOCABULARY.index("=")
_APPLY = {"max": max, "min": min, "first": lambda ds: ds[0], "last": lambda ds: ds[-1]}


@dataclass(frozen=True)
class DigitToolEnv:
    """The calculator tool over the digit task.

    Attributes:
        task: the task whose prompts are served (token ids and reward).
    """

    task: DigitTask = field(default_factory=DigitTask)

    def prompt_digits(self, prompt_ids: Sequence[int]) -> list[int]:
        """The digits ``d1 .. dn`` of a task prompt ``<bos> op d1 .. dn =`` (ints 0..9).

        Raises:
            ToolEnvError: the prompt does not have that form.
        """
        ids = [int(t) for t in prompt_ids]
        if (len(ids) < 4 or ids[0] != self.task.bos_id or ids[1] not in _OPERATOR_IDS
                or ids[-1] != _EQUALS_ID or any(t not in _DIGIT_IDS for t in ids[2:-1])):
            raise ToolEnvError(f"prompt {ids} is not of the form <bos> op d1 .. dn =")
        return [_DIGIT_IDS[t] for t in ids[2:-1]]

    def tool_call(self, turn_ids: Sequence[int]) -> str | None:
        """The operator name if this turn is a tool call (first token an operator), else None."""
        return _OPERATOR_IDS.get(int(turn_ids[0])) if len(turn_ids) else None

    def observe(self, prompt_ids: Sequence[int], turn_ids: Sequence[int]) -> np.ndarray | None:
        """The environment's answer to one turn.

        Args:
            prompt_ids: the episode's original prompt (the tool's data).
            turn_ids: the tokens the policy generated in this turn.

        Returns:
            int32 ``[2]`` observation ``= d`` for a tool call, None for a final answer.

        Raises:
            ToolEnvError: a tool call on a prompt that is not a task prompt.
        """
        op = self.tool_call(turn_ids)
        if op is None:
            return None
        value = _APPLY[op](self.prompt_digits(prompt_ids))
        return np.asarray([_EQUALS_ID, VOCABULARY.index(str(value))], dtype=np.int32)

    def final_answer(self, response_ids: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
        """The tokens after the last observation token (loss_mask 0), i.e. the last turn.

        Raises:
            ToolEnvError: lengths differ.
        """
        if len(response_ids) != len(loss_mask):
            raise ToolEnvError(f"response_ids ({len(response_ids)}) and loss_mask "
                               f"({len(loss_mask)}) differ in length")
        observed = np.flatnonzero(np.asarray(loss_mask) == 0)
        start = int(observed[-1]) + 1 if len(observed) else 0
        return np.asarray(response_ids[start:])

    def reward(self, response_ids: np.ndarray, loss_mask: np.ndarray, answer_id: int) -> float:
        """Reward in [0, 1]: ``task.reward`` of :meth:`final_answer` (0 if it is a tool call).

        Raises:
            ToolEnvError: lengths differ. replayrl.rollout.tasks.digit_puzzle.TaskError: a token outside the vocabulary.
        """
        return self.task.reward(self.final_answer(response_ids, loss_mask), answer_id)


class DigitCalculatorEnv(ObserveAdapter):
    """The digit calculator as an ``--env`` environment (``--env digit_calculator``).

    The built-in task's own environment, :class:`DigitToolEnv`, behind the
    :class:`ObserveAdapter` the turn loop drives it through: a turn whose first token is an
    operator is a call, answered with the token ids ``= d``; any other turn is the final answer
    (``done``). Step reward 0: the verifier (``--rm-type digits``) scores. A run with
    ``--env digit_calculator`` gives the trajectories the built-in environment gives (its
    failures, as any ``--env`` environment's, end one trajectory under ``--env-failure abort``).

    Args:
        config: the run's rollout settings (``None`` in tests).
    """

    def __init__(self, config=None) -> None:
        super().__init__(DigitToolEnv(), config)

    @property
    def tool(self) -> DigitToolEnv:
        """The calculator this environment answers with."""
        return self.observer
