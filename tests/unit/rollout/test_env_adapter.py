"""One environment API (rollout/tasks/environment.py): a task's ``observe`` environment behind
:class:`ObserveAdapter` presents its observations exactly, and the turn loop drives it and an
``--env`` environment through the same call path.

Ids are the digit vocabulary's (rollout/tasks/digit_puzzle.py), written out by hand:
``<bos>`` 1, ``<eos>`` 2, digit ``d`` is ``d + 3``, ``max`` 13, ``min`` 14, ``=`` 17, ``a`` 18.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from replayrl.rollout.engines.base import Generation
from replayrl.rollout.episodes.env_sessions import EnvSessions
from replayrl.rollout.episodes.turn_loop import run_episodes
from replayrl.rollout.errors import ToolEnvError, TurnLoopError
from replayrl.rollout.tasks.calculator import DigitCalculatorEnv, DigitToolEnv
from replayrl.rollout.tasks.environment import ObserveAdapter, Step, ToolEnvironment, Turn
from replayrl.rollout.text.data_source import Prompt

BOS, EOS, MAX, MIN, EQ, A = 1, 2, 13, 14, 17, 18
PROMPT_0 = [BOS, MAX, 6, 4, 7, 5, EQ]  # <bos> max 3 1 4 2 =
PROMPT_1 = [BOS, MIN, 8, 9, EQ]        # <bos> min 5 6 =


def _prompt(index: int, ids: list[int]) -> Prompt:
    return Prompt(index, np.asarray(ids, np.int32), -1)


def _turn(index: int, ids: list[int]) -> Turn:
    return Turn(index, np.asarray(ids, np.int32), "", (), "stop")


class Recording:
    """An ``observe`` environment that records what it is given and answers from a script."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.calls = []

    def observe(self, prompt_ids, turn_ids):
        self.calls.append((prompt_ids, turn_ids))
        return self.answers.pop(0)


async def test_the_adapter_passes_the_ids_in_and_the_observation_out_unchanged():
    answer = np.asarray([EQ, 7], np.int32)
    observer = Recording([answer, None])
    env = ObserveAdapter(observer)
    assert isinstance(env, ToolEnvironment) and env.tools == ()
    assert await env.reset(_prompt(0, PROMPT_0)) is None
    turn = _turn(0, [MAX, A, EOS])
    step = await env.step(turn)
    # ids in: the prompt's ids as ints, the turn's own array (not a copy)
    (prompt_ids, turn_ids), = observer.calls
    assert prompt_ids == [1, 13, 6, 4, 7, 5, 17] and all(type(t) is int for t in prompt_ids)
    assert turn_ids is turn.ids
    # ids out: the observation itself, reward 0, not done
    assert step == Step(observation=answer, reward=0.0, done=False)
    assert step.observation is answer
    # None: the final answer
    assert await env.step(_turn(1, [7, EOS])) == Step(observation=None, reward=0.0, done=True)
    assert env.parse_tool_calls('<tool_call>{"name": "f"}</tool_call>') == ()


@pytest.mark.parametrize("turn, expected", [
    ([MIN, A, EOS], [17, 4]),  # min of 3 1 4 2 -> "= 1"
    ([MAX], [17, 7]),          # "= 4"
    ([15, 10], [17, 6]),       # first -> "= 3"
    ([16], [17, 5]),           # last -> "= 2"
    ([7, EOS], None),          # a digit first: the final answer
    ([A, MAX], None),          # only a leading operator calls the tool
])
async def test_the_digit_calculator_behind_the_adapter_answers_as_observe_does(turn, expected):
    tool = DigitToolEnv()
    env = ObserveAdapter(tool)
    await env.reset(_prompt(0, PROMPT_0))
    step = await env.step(_turn(0, turn))
    direct = tool.observe(PROMPT_0, turn)
    if expected is None:
        assert direct is None and step == Step(None, 0.0, True)
    else:
        assert direct.tolist() == expected and step.observation.tolist() == expected
        assert step.observation.dtype == np.int32 and not step.done


async def test_task_sessions_append_the_ids_and_keep_the_task_errors():
    sessions = EnvSessions.of_task(DigitToolEnv(), [_prompt(0, PROMPT_0), _prompt(1, [BOS, MAX, A, EQ])])
    await sessions.start()
    answer = await sessions.respond(0, 0, _gen([MIN, EOS]))
    assert answer.observation.tolist() == [17, 4] and answer.reward == 0.0 and answer.failure == ""
    final = await sessions.respond(0, 1, _gen([4, EOS]))
    assert final.observation is None and final.failure == ""
    # the task's environment is part of the task: its error ends the run as it is
    with pytest.raises(ToolEnvError, match=r"is not of the form <bos> op d1 .. dn ="):
        await sessions.respond(1, 0, _gen([MAX]))


def _gen(ids: list[int]) -> Generation:
    finish = "stop" if ids[-1] == EOS else "length"
    return Generation(response_ids=np.asarray(ids, np.int32),
                      rollout_logprobs=np.full(len(ids), -0.5, np.float32), finish_reason=finish)


# the engine's turns, per row: row 0 calls max then answers 4; row 1 answers 5 at once
SCRIPT = {0: [[MAX, EOS], [7, EOS]], 1: [[8, EOS]]}
RESPOND = EnvSessions.respond


def _run(sessions, monkeypatch):
    """The turn loop over PROMPT_0 and PROMPT_1 with ``sessions``; returns the episodes, every
    context the engine saw, and every (row, turn) the sessions were asked to answer."""
    seen, asked = [], []

    async def recording_respond(self, row, turn, generation, room=None):
        asked.append((row, turn))
        return await RESPOND(self, row, turn, generation, room)

    monkeypatch.setattr(EnvSessions, "respond", recording_respond)
    turn = iter(range(3))

    async def generate_turn(contexts, seed):
        t = next(turn)
        seen.append([list(c) for c in contexts])
        rows = [r for r in (0, 1) if len(SCRIPT[r]) > t]
        return [_gen(SCRIPT[r][t]) for r in rows], 0

    episodes = asyncio.run(run_episodes(generate_turn, [PROMPT_0, PROMPT_1], max_turns=3,
                                        max_new_tokens=2, max_positions=64, seed=0, env=sessions))
    return episodes, seen, asked


def test_run_episodes_drives_both_kinds_through_the_same_path(monkeypatch):
    records = [_prompt(0, PROMPT_0), _prompt(1, PROMPT_1)]
    task = _run(EnvSessions.of_task(DigitToolEnv(), records), monkeypatch)
    env = _run(EnvSessions(DigitCalculatorEnv, records, tokenizer=None, timeout_s=5.0,
                           name="digit_calculator"), monkeypatch)
    for episodes, seen, asked in (task, env):
        assert asked == [(0, 0), (1, 0), (0, 1)]  # every turn of both kinds: sessions.respond
        # turn 1 of row 0: its prompt, its turn "max <eos>", the observation "= 4"
        assert seen[1] == [[1, 13, 6, 4, 7, 5, 17, 13, 2, 17, 7]]
        first, second = episodes
        assert [o.tolist() for o in first.observations] == [[17, 7]]
        assert (first.finish_reason, first.num_tool_calls, first.env_reward) == ("stop", 1, 0.0)
        assert (second.finish_reason, second.num_tool_calls, second.observations) == ("stop", 0, ())
    assert task[1] == env[1]


def test_run_episodes_takes_sessions_only():
    async def generate_turn(contexts, seed):
        raise AssertionError("never called")

    with pytest.raises(TurnLoopError, match=r"EnvSessions\.of_task"):
        asyncio.run(run_episodes(generate_turn, [PROMPT_0], max_turns=2, max_new_tokens=2,
                                 max_positions=64, seed=0, env=DigitToolEnv()))
    with pytest.raises(TurnLoopError, match="hold 1 prompts, not the 2 given"):
        asyncio.run(run_episodes(generate_turn, [PROMPT_0, PROMPT_1], max_turns=2,
                                 max_new_tokens=2, max_positions=64, seed=0,
                                 env=EnvSessions.of_task(DigitToolEnv(), [_prompt(0, PROMPT_0)])))
