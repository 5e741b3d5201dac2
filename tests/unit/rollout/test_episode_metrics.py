"""The per-episode figures of a multi-turn batch (rollout/dispatch/episode_metrics.py) on
episodes whose turns, unreadable tool calls and rewards are known by hand: a scripted turn
loop over a Hermes-parsing environment counts the parser's errors per episode."""
from __future__ import annotations

import numpy as np
import pytest

from replayrl.rollout.dispatch.episode_metrics import episode_metrics
from replayrl.rollout.engines.base import Generation
from replayrl.rollout.episodes.env_sessions import EnvSessions
from replayrl.rollout.episodes.turn_loop import run_episodes
from replayrl.rollout.tasks.environment import Step, ToolEnvironment, tool_result
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.text.tokenizer import load_tokenizer
from tests.chat_checkpoint import write_chat_tokenizer

GOOD = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
NOT_JSON = "<tool_call>{add</tool_call>"
UNCLOSED = "<tool_call>{"
# per episode: its turns (the last is the final answer) and, by hand, the unreadable calls
SCRIPTS = [([NOT_JSON, GOOD + UNCLOSED, "7"], 2),  # not JSON (1), then unclosed (1)
           ([GOOD, "7"], 0),
           (["7"], 0)]


class Answers(ToolEnvironment):
    """Answers every call (an unreadable one with its error); a turn without calls is final."""

    async def step(self, turn):
        if not turn.tool_calls:
            return Step(None, done=True)
        return Step("; ".join(tool_result(c, "ok") for c in turn.tool_calls))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat")
    write_chat_tokenizer(directory)
    return load_tokenizer(directory, apply_chat_template=True)


def _generation(tok, text: str) -> Generation:
    ids = np.array(tok.tokenizer(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                   np.int32)
    return Generation(response_ids=ids, rollout_logprobs=np.zeros(len(ids), np.float32),
                      finish_reason="stop", sample_support=None, routed_experts=None,
                      indexer_topk=None)


async def test_turns_parse_errors_and_accuracy_by_hand(tok):
    prompts = [Prompt(i, tok.encode_prompt("q"), -1) for i in range(len(SCRIPTS))]
    turn_of = [0] * len(SCRIPTS)
    running = list(range(len(SCRIPTS)))  # the turn loop keeps the batch order of running rows

    async def scripted(contexts, seed):
        nonlocal running
        assert len(contexts) == len(running)
        out = [_generation(tok, SCRIPTS[row][0][turn_of[row]]) for row in running]
        for row in running:
            turn_of[row] += 1
        running = [row for row in running if turn_of[row] < len(SCRIPTS[row][0])]
        return out, 0

    sessions = EnvSessions(Answers, prompts, tokenizer=tok, timeout_s=None)
    episodes = await run_episodes(scripted, [p.prompt_ids for p in prompts], max_turns=4,
                                  max_new_tokens=64, max_positions=512, seed=0, env=sessions)
    assert [len(e.turns) for e in episodes] == [len(turns) for turns, _ in SCRIPTS]
    assert [e.parse_errors for e in episodes] == [errors for _, errors in SCRIPTS]
    assert [e.finish_reason for e in episodes] == ["stop"] * 3
    # the verifier's rewards: right, half right, right -> accuracy 2 / 3
    metrics = episode_metrics(episodes, [1.0, 0.5, 1.0], env=True)
    assert metrics == {"turns_mean": (3 + 2 + 1) / 3, "parse_errors_mean": 2 / 3,
                       "final_answer_accuracy": 2 / 3}
    # no environment: no parser; no verifier (--env-reward env): no accuracy
    assert episode_metrics(episodes, [None, 1.0, 1.0], env=False) == {"turns_mean": 2.0}
    with pytest.raises(ValueError, match="3 episodes with 2 verifier rewards"):
        episode_metrics(episodes, [1.0, 1.0], env=True)
