"""Your own environment (``--env``, rollout/tasks/environment.py): tool calls in the chat
template's format, observations rendered as tool messages and appended as ids, and bad
environments ending only their own trajectory.

Token fidelity is checked against transformers: the ids the trainer gets (prompt + response)
are, token for token, ``apply_chat_template`` of the whole conversation (tools included), and
every engine call's context is the conversation so far with the generation prompt -- both
rendered by transformers from the messages, never by the code under test. The template puts a
separator ("\\n") after the end-of-turn token.
"""
from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from replayrl.rollout.episodes.env_sessions import EnvSessions
from replayrl.rollout.episodes.turn_loop import assemble, run_episodes
from replayrl.rollout.errors import EnvironmentFailure
from replayrl.rollout.tasks import ENVIRONMENTS, load_environment_class
from replayrl.rollout.tasks.environment import Reset, Step, ToolEnvironment, hermes_tool_calls
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.text.tokenizer import load_tokenizer
from tests.unit.rollout.test_turn_separator import QWEN_TEMPLATE, _gen, _ids, _make_tokenizer

# Qwen's layout with a tools block (names only) in a system turn, as Qwen3 / Hermes render tools
TOOLS_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}"
                  "{{- t.function.name + '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
                  + QWEN_TEMPLATE)
CALC = load_environment_class("python_calculator")
RETRIEVAL = load_environment_class("retrieval")


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return _make_tokenizer(tmp_path_factory.mktemp("tools"), "qwen_tools", TOOLS_TEMPLATE,
                           ["<|im_start|>", "<|im_end|>"], "<|im_end|>")


def _prompt(tok, text: str, index: int = 0) -> Prompt:
    return Prompt(index, tok.encode_prompt(text), -1, "", source=f"prompts.jsonl:{index + 1}")


def _call(name: str, **arguments) -> str:
    import json
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


async def _episodes(tok, env_cls, prompts, turns, *, max_positions=4096, timeout=5.0,
                    failure="abort", max_turns=3):
    """Run the turn loop; ``turns[row]`` are the texts the fake engine writes in turn order
    (each ends with the end-of-turn token). Returns the episodes and every context seen."""
    eot = tok.eos_token_id
    seen: list[list[list[int]]] = []
    t = iter(range(100))

    async def generate_turn(contexts, seed):
        k = next(t)
        seen.append([list(c) for c in contexts])
        rows = [r for r in range(len(prompts)) if len(turns[r]) > k][:len(contexts)]
        return [_gen(_ids(tok, turns[r][k]) + [eot], "stop") for r in rows], 0

    sessions = EnvSessions(lambda: env_cls(None), prompts, tokenizer=tok, timeout_s=timeout,
                           failure=failure, name="test-env")
    episodes = await run_episodes(generate_turn, [p.prompt_ids for p in prompts],
                                  max_turns=max_turns, max_new_tokens=8,
                                  max_positions=max_positions, seed=0, env=sessions)
    return episodes, seen


def _whole(tok, messages, tools, **kw) -> list[int]:
    return _ids(tok, tok.tokenizer.apply_chat_template(messages, tools=list(tools),
                                                       tokenize=False, **kw))


# ----------------------------------------------------------------------------- the parser


def test_hermes_tool_calls_read_json_calls_and_name_malformed_ones():
    calls = hermes_tool_calls('x <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
                              '<tool_call>{"name": "g"}</tool_call>')
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [("f", {"a": 1}, ""),
                                                                    ("g", {}, "")]
    assert hermes_tool_calls("the answer is 4") == ()
    (bad,) = hermes_tool_calls("<tool_call>{name: f}</tool_call>")
    assert bad.name == "" and "not JSON" in bad.error
    (shape,) = hermes_tool_calls('<tool_call>["f"]</tool_call>')
    assert "must be" in shape.error
    (cut,) = hermes_tool_calls('<tool_call>{"name": "f", "argu')
    assert cut.error == "unclosed <tool_call>"


# ----------------------------------------------------------------------------- token fidelity


@pytest.mark.parametrize("env_cls, call, observation_check, answer", [
    (RETRIEVAL, _call("search", query="capital of Australia"),
     lambda text: text.splitlines()[0] == "Canberra is the capital city of Australia.",
     "Canberra"),
])
async def test_trained_ids_are_the_ids_every_engine_call_saw(tokdir, env_cls, call,
                                                             observation_check, answer):
    tok = load_tokenizer(tokdir, apply_chat_template=True, tools=env_cls.tools)
    prompt = _prompt(tok, "question?")
    (episode,), seen = await _episodes(tok, env_cls, [prompt], [[call, answer]])
    assert episode.finish_reason == "stop" and episode.failure == "" and episode.num_tool_calls == 1
    # the tool's answer, read back from the context the engine saw (after the tool_response tag)
    ctx1 = tok.tokenizer.decode(seen[1][0])
    tool_text = ctx1.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    assert observation_check(tool_text)
    messages = [{"role": "user", "content": "question?"},
                {"role": "assistant", "content": call},
                {"role": "tool", "content": tool_text},
                {"role": "assistant", "content": answer}]
    tools = env_cls.tools
    assert seen[0][0] == _whole(tok, messages[:1], tools, add_generation_prompt=True)
    assert seen[1][0] == _whole(tok, messages[:3], tools, add_generation_prompt=True)
    merged, _ = assemble(episode, sample_id=0, require=())
    f = merged.sample_fields()
    trained = list(episode.prompt_ids) + f["response_ids"].tolist()
    whole = _whole(tok, messages, tools)
    assert trained == whole[:len(trained)] and whole[len(trained):] == _ids(tok, "\n")
    for k, contexts in enumerate(seen):  # every engine call's context is a prefix
        assert trained[:len(contexts[0])] == contexts[0], k
    n0, n1 = len(_ids(tok, call)) + 1, len(_ids(tok, answer)) + 1
    assert f["loss_mask"].tolist() == [1] * n0 + [0] * (len(f["loss_mask"]) - n0 - n1) + [1] * n1
    assert (f["rollout_logprobs"][f["loss_mask"] == 0] == 0.0).all()


def _opening_env(opening):
    """An environment whose reset opens the episode with ``opening``; it answers a call with
    "ok" and ends on a turn without one."""
    class Opening(ToolEnvironment):
        async def reset(self, prompt):
            return Reset(observation=opening)

        async def step(self, turn):
            return Step(observation="ok") if turn.tool_calls else Step(done=True)
    return Opening


@pytest.mark.parametrize("opening, messages", [
    ("episode 7: the tools are ready", [{"role": "tool", "content": "episode 7: the tools are ready"}]),
    ([{"role": "system", "content": "answer in one word"}],
     [{"role": "system", "content": "answer in one word"}]),
    ([{"role": "system", "content": "rules"}, {"role": "tool", "content": "first result"}],
     [{"role": "system", "content": "rules"}, {"role": "tool", "content": "first result"}]),
])
async def test_an_opening_observation_is_in_the_ids_the_first_call_saw_and_the_trainer_trains_on(
        tokdir, opening, messages):
    tok = load_tokenizer(tokdir, apply_chat_template=True, tools=CALC.tools)
    prompt = _prompt(tok, "question?")
    call, answer = _call("calculate", expression="1 + 1"), "2"
    (episode,), seen = await _episodes(tok, _opening_env(opening), [prompt], [[call, answer]])
    assert episode.finish_reason == "stop" and episode.failure == "" and episode.num_tool_calls == 1
    user = [{"role": "user", "content": "question?"}]
    # the first engine call saw the prompt, then the opening, then the generation prompt
    first = _whole(tok, user + messages, CALC.tools, add_generation_prompt=True)
    assert seen[0][0] == first and list(episode.prompt_ids) == first
    assert first[:len(prompt.prompt_ids) - len(_ids(tok, "<|im_start|>assistant\n"))] == \
        list(prompt.prompt_ids)[:-len(_ids(tok, "<|im_start|>assistant\n"))]  # exact prompt ids kept
    conversation = user + messages + [{"role": "assistant", "content": call},
                                      {"role": "tool", "content": "ok"},
                                      {"role": "assistant", "content": answer}]
    merged, _ = assemble(episode, sample_id=0, require=())
    f = merged.sample_fields()
    trained = list(episode.prompt_ids) + f["response_ids"].tolist()
    whole = _whole(tok, conversation, CALC.tools)
    assert trained == whole[:len(trained)] and whole[len(trained):] == _ids(tok, "\n")
    for k, contexts in enumerate(seen):
        assert trained[:len(contexts[0])] == contexts[0], k
    # the response starts with turn 0: the opening is prompt (never trained), not response
    n0, n1 = len(_ids(tok, call)) + 1, len(_ids(tok, answer)) + 1
    assert f["loss_mask"].tolist() == [1] * n0 + [0] * (len(f["loss_mask"]) - n0 - n1) + [1] * n1


async def test_an_opening_observation_without_the_chat_template_is_appended_as_text(tokdir):
    tok = load_tokenizer(tokdir)
    prompt = Prompt(0, tok.encode_prompt("q?"), -1, "", source="prompts.jsonl:1")
    (episode,), seen = await _episodes(tok, _opening_env("hello"), [prompt], [["x"]])
    assert seen[0][0] == list(prompt.prompt_ids) + _ids(tok, "hello") == list(episode.prompt_ids)


@pytest.mark.parametrize("opening, detail", [
    (42, "reset: malformed: reset() returned an opening observation of type int"),
    ([{"role": "system"}], "reset: malformed: reset() returned an opening observation of type list"),
    ("", "reset: malformed: reset() returned an empty opening observation"),
    ("z" * 300, "reset: observation_too_long: the prompt with its opening observation is"),
])
async def test_a_malformed_or_too_long_opening_ends_the_trajectory_at_its_first_turn(
        tokdir, opening, detail):
    tok = load_tokenizer(tokdir, apply_chat_template=True)
    prompt = _prompt(tok, "q")
    (episode,), seen = await _episodes(tok, _opening_env(opening), [prompt], [[_call("f")]],
                                       max_positions=len(prompt.prompt_ids) + 200)
    assert episode.finish_reason == "env_error" and detail in episode.failure
    assert seen[0][0] == list(prompt.prompt_ids) == list(episode.prompt_ids)


# ----------------------------------------------------------------------------- the examples


def test_bm25_matches_a_naive_reference():
    import sys
    mod = sys.modules[RETRIEVAL.__module__]
    passages = ["a b b c", "b c d", "e"]
    index = mod.BM25(passages)
    docs = [p.split() for p in passages]
    avg = sum(map(len, docs)) / 3
    for query in ("b", "a c", "d e z"):
        expected = []
        for d in docs:
            s = 0.0
            for w in query.split():
                df = sum(w in x for x in docs)
                if df == 0:
                    continue
                idf = math.log(1 + (3 - df + 0.5) / (df + 0.5))
                tf = d.count(w)
                s += idf * tf * 2.5 / (tf + 1.5 * (0.25 + 0.75 * len(d) / avg))
            expected.append(s)
        np.testing.assert_allclose(index.scores(query), expected)
    assert index.search("d e") == ["e", "b c d"]


def test_the_examples_are_registered_and_loadable_by_path():
    for name in ("python_calculator", "retrieval", "digit_calculator"):
        assert issubclass(load_environment_class(name), ToolEnvironment)
    assert load_environment_class(ENVIRONMENTS["retrieval"]).__name__ == "RetrievalEnv"


# ----------------------------------------------------------------------------- bad environments


class Raising(ToolEnvironment):
    async def step(self, turn):
        raise RuntimeError("tool crashed")


class Hanging(ToolEnvironment):
    async def step(self, turn):
        await asyncio.sleep(60)


class Malformed(ToolEnvironment):
    async def step(self, turn):
        return {"observation": "42"}


class Flooding(ToolEnvironment):
    async def step(self, turn):
        return Step(observation="z" * 500) if turn.tool_calls else Step(done=True)


BAD = {"raised": (Raising, "RuntimeError: tool crashed"),
       "timeout": (Hanging, "no answer within --env-timeout-seconds 0.2"),
       "malformed": (Malformed, "step() returned dict, not a Step"),
       "observation_too_long": (Flooding, "the observation is")}


def _picky(bad_cls):
    """Row 1 gets the bad environment; row 0 a good one (answers "ok", then done)."""
    class Mixed(ToolEnvironment):
        async def reset(self, prompt):
            self.bad = bad_cls() if prompt.index == 1 else None

        async def step(self, turn):
            if self.bad is not None:
                return await self.bad.step(turn)
            return Step(observation="ok") if turn.tool_calls else Step(done=True)
    return Mixed


@pytest.mark.parametrize("kind", sorted(BAD))
async def test_a_bad_environment_ends_only_its_trajectory_naming_prompt_and_turn(tokdir, kind):
    bad_cls, detail = BAD[kind]
    tok = load_tokenizer(tokdir, apply_chat_template=True)
    prompts = [_prompt(tok, "good?", 0), _prompt(tok, "bad?", 1)]
    call = _call("f")
    (good, bad), _ = await asyncio.wait_for(_episodes(
        tok, _picky(bad_cls), prompts, [[call, "done"], [call, "never"]], timeout=0.2,
        max_positions=len(prompts[1].prompt_ids) + len(_ids(tok, call)) + 200), 10)
    assert good.finish_reason == "stop" and good.failure == "" and good.num_tool_calls == 1
    assert bad.finish_reason == "env_error" and len(bad.turns) == 1
    assert bad.failure.startswith(f"environment test-env at prompt prompts.jsonl:2 (row 1), "
                                  f"turn 0: {kind}: ")
    assert detail in bad.failure


@pytest.mark.parametrize("kind", sorted(BAD))
async def test_env_failure_error_ends_the_run_naming_prompt_and_turn(tokdir, kind):
    bad_cls, _ = BAD[kind]
    tok = load_tokenizer(tokdir, apply_chat_template=True)
    prompts = [_prompt(tok, "bad?", 0)]
    call = _call("f")
    with pytest.raises(EnvironmentFailure, match=r"prompt prompts.jsonl:1 \(row 0\), turn 0") as info:
        await asyncio.wait_for(_episodes(
            tok, bad_cls, prompts, [[call, "x"]], timeout=0.2, failure="error",
            max_positions=len(prompts[0].prompt_ids) + len(_ids(tok, call)) + 200), 10)
    assert info.value.kind == kind


async def test_a_failing_reset_ends_the_trajectory_at_its_first_turn(tokdir):
    class BadReset(ToolEnvironment):
        async def reset(self, prompt):
            raise KeyError("no such document")

        async def step(self, turn):
            raise AssertionError("never stepped")

    tok = load_tokenizer(tokdir, apply_chat_template=True)
    (episode,), _ = await _episodes(tok, BadReset, [_prompt(tok, "q")], [[_call("f")]])
    assert episode.finish_reason == "env_error" and "reset: raised: KeyError" in episode.failure


def test_a_turn_text_keeps_special_tool_call_tokens_and_drops_the_stop_id(tmp_path):
    """A template whose <tool_call> is a special token: the parser still sees the call."""
    from replayrl.rollout.episodes.env_sessions import turn_text
    d = _make_tokenizer(tmp_path, "special_calls", QWEN_TEMPLATE,
                        ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"], "<|im_end|>")
    tok = load_tokenizer(d, apply_chat_template=True)
    specials = {s: tok.tokenizer.convert_tokens_to_ids(s) for s in ("<tool_call>", "</tool_call>")}
    body = '{"name": "f", "arguments": {}}'
    ids = np.array([specials["<tool_call>"], *_ids(tok, body), specials["</tool_call>"],
                    tok.eos_token_id], np.int32)
    assert turn_text(tok, ids) == f"<tool_call>{body}</tool_call>"
    assert [c.name for c in hermes_tool_calls(turn_text(tok, ids))] == ["f"]


@pytest.mark.parametrize("answer, detail", [
    ("tools", "reset: malformed: reset() returns"),
    ("other", "reset: malformed: reset() offers tools other than"),
])
async def test_a_reset_that_answers_another_schema_or_no_reset_is_refused(tokdir, answer, detail):
    from replayrl.rollout.tasks.environment import Reset

    class OddReset(ToolEnvironment):
        tools = ({"type": "function", "function": {"name": "a"}},)

        async def reset(self, prompt):
            return list(self.tools) if answer == "tools" else Reset(
                ({"type": "function", "function": {"name": "b"}},))

        async def step(self, turn):
            raise AssertionError("never stepped")

    tok = load_tokenizer(tokdir, apply_chat_template=True)
    (episode,), _ = await _episodes(tok, OddReset, [_prompt(tok, "q")], [[_call("a")]])
    assert episode.finish_reason == "env_error"
    assert detail.replace("returns", "returned list, not a Reset or None") in episode.failure
