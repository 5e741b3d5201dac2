"""The configured built-in reward (``--rm-type``) as a task's reward call.

Every trajectory is scored on its *final segment*, the tokens after the last observation token
(loss mask 0), i.e. the last turn; a single-turn trajectory's final segment is its whole
response:

* ``digits``: the digit puzzle's verifier on the final segment's token ids against the label's
  token id (:meth:`replayrl.rollout.tasks.calculator.DigitToolEnv.reward`), inline;
* ``exact``: :func:`replayrl.rollout.scoring.rewards.exact_reward` of the final segment's text, inline;
* ``math``: :func:`replayrl.rollout.scoring.rewards.math_reward` of that text, on a thread of its own
  under ``--reward-timeout-seconds``.

The text is decoded here, on the caller's thread (the manager's), before the call.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from replayrl.rollout.scoring.rewards import RewardCall, RewardError, exact_reward, math_reward
from replayrl.rollout.tasks.calculator import DigitToolEnv
from replayrl.rollout.text.data_source import Prompt

if TYPE_CHECKING:
    from replayrl.rollout.text.tokenizer import PromptTokenizer

__all__ = ["digits_reward", "rm_type_reward"]

# The verifier reads token ids only: the puzzle's prompt settings do not enter the reward, so
# one environment scores every run's trajectories.
_VERIFIER = DigitToolEnv()


def digits_reward(response_ids: np.ndarray, loss_mask: np.ndarray, answer_id: int) -> float:
    """``--rm-type digits``: the digit puzzle's reward in [0, 1] of the final segment.

    Raises:
        RewardError: ``answer_id < 0`` (the label is not one vocabulary token).
        replayrl.rollout.tasks.calculator.ToolEnvError: lengths differ.
        replayrl.rollout.tasks.digit_puzzle.TaskError: a negative token id.
    """
    if answer_id < 0:
        raise RewardError("--rm-type digits needs a label that is one token of the "
                          "vocabulary (the answer digit)")
    return _VERIFIER.reward(response_ids, loss_mask, answer_id)


def rm_type_reward(rm_type: str, tokenizer: PromptTokenizer, prompt: Prompt,
                   response_ids: np.ndarray, loss_mask: np.ndarray) -> RewardCall:
    """The reward call of ``--rm-type rm_type`` for one trajectory.

    Args:
        rm_type: ``digits``, ``exact`` or ``math`` (``replayrl.rollout.config.RM_TYPES``).
        tokenizer: decodes the final segment for the text rewards.
        prompt: the trajectory's prompt (``answer_id`` for digits, ``label`` for the others).
        response_ids, loss_mask: the trajectory's response, int32 / uint8 ``[R]``.
    Raises:
        replayrl.rollout.tasks.calculator.ToolEnvError: a text reward's ``response_ids`` and
            ``loss_mask`` differ in length.
    """
    if rm_type == "digits":
        return RewardCall(digits_reward, (response_ids, loss_mask, prompt.answer_id), bounded=True)
    text = tokenizer.decode(_VERIFIER.final_answer(response_ids, loss_mask))
    if rm_type == "exact":
        return RewardCall(exact_reward, (text, prompt.label), bounded=True)
    return RewardCall(math_reward, (text, prompt.label))
