"""The example environments with format credit, for training a policy that starts random
(``--env examples/environments/format_credit.py:CalculatorWithFormatCredit`` or
``...:RetrievalWithFormatCredit``, with ``--env-reward sum``).

They answer tool calls exactly as :class:`PythonCalculatorEnv` / :class:`RetrievalEnv` do and
add a step reward on the first turn (turn 0) only:

* 0.25 when the turn's text contains ``<tool_call>``;
* another 0.25 when :func:`replayrl.rollout.tasks.environment.hermes_tool_calls` reads at least
  one call that names the environment's tool with its argument a string (a well-formed call).

Later turns get step reward 0. With ``--env-reward sum`` and ``--rm-type exact`` a trajectory's
reward is therefore ``format credit (0, 0.25 or 0.5) + exact match of the final answer with the
label (0 or 1)``, in [0, 1.5].
"""
from __future__ import annotations

from dataclasses import replace

from replayrl.rollout.tasks import load_environment_class
from replayrl.rollout.tasks.environment import Step, Turn

OPEN_CREDIT = 0.25
CALL_CREDIT = 0.25


def format_credit(turn: Turn, tool: str, argument: str) -> float:
    """The format credit of one turn (see the module docstring): 0.0, 0.25 or 0.5 on turn 0,
    0.0 on any later turn."""
    if turn.index != 0:
        return 0.0
    credit = OPEN_CREDIT if "<tool_call>" in turn.text else 0.0
    if any(not c.error and c.name == tool and isinstance(c.arguments.get(argument), str)
           for c in turn.tool_calls):
        credit += CALL_CREDIT
    return credit


class CalculatorWithFormatCredit(load_environment_class("python_calculator")):
    """The Python calculator plus format credit for a ``calculate(expression)`` call."""

    async def step(self, turn: Turn) -> Step:
        """The calculator's answer, its reward raised by :func:`format_credit`."""
        step = await super().step(turn)
        return replace(step, reward=step.reward + format_credit(turn, "calculate", "expression"))


class RetrievalWithFormatCredit(load_environment_class("retrieval")):
    """The retrieval tool plus format credit for a ``search(query)`` call."""

    async def step(self, turn: Turn) -> Step:
        """The search answer, its reward raised by :func:`format_credit`."""
        step = await super().step(turn)
        return replace(step, reward=step.reward + format_credit(turn, "search", "query"))
