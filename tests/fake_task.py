"""A task added the way docs/architecture.md "Where to add" says: this one file, plus one
registry line (``TASKS["fake"] = "tests.fake_task:FakeTask"``, done by the tests through
monkeypatch). Used by tests/unit/rollout/test_task_room.py.

Prompts: :data:`PROMPTS`, fixed token ids of the embedded vocabulary. Reward: 1.0 when the
response's first token id is even, else 0.0 (inline: bounded by the response length). No
multi-turn environment.
"""
from __future__ import annotations

import numpy as np

from replayrl.rollout.tasks.base import RewardCall, Task, TaskPrompts
from replayrl.rollout.text.data_source import Prompt

PROMPTS = ((1, 13, 3, 4, 5, 17), (1, 14, 6, 7, 8, 17), (1, 15, 9, 9, 3, 17))
"""Three prompts (``<bos> op d d d =`` ids of the embedded vocabulary)."""


def first_token_even(response_ids: np.ndarray) -> float:
    """1.0 when ``response_ids[0]`` is even, else 0.0 (0.0 for an empty response)."""
    return 1.0 if len(response_ids) and int(response_ids[0]) % 2 == 0 else 0.0


class FakeTask(Task):
    """:data:`PROMPTS` for training and refill, the even-first-token reward, no environment."""

    def prompts(self, tokenizer, *, vocab_size: int, max_prompt_len: int) -> TaskPrompts:
        """:data:`PROMPTS` as read-only int32 arrays (the tokenizer is not needed)."""
        out = []
        for i, ids in enumerate(PROMPTS):
            array = np.asarray(ids, dtype=np.int32)
            array.flags.writeable = False
            out.append(Prompt(i, array, -1, source=f"fake:{i + 1}"))
        return TaskPrompts(out, out, "fake prompts")

    def reward(self, tokenizer, prompt: Prompt, response_ids: np.ndarray,
               loss_mask: np.ndarray) -> RewardCall:
        """:func:`first_token_even` of the response, inline."""
        return RewardCall(first_token_even, (response_ids,), bounded=True)
