"""``--env`` through the rollout manager, in-process (a real EngineActor with the fake
tool-calling engine of tests/fake_engine.py, a real RolloutManager, a forwarding proxy):

* the digit calculator behind the environment interface (``--env digit_calculator``) gives the
  trajectories and rewards of the built-in environment, sample for sample;
* a bad environment ends its own trajectories (status ``aborted``, ``env_failures`` and the
  messages naming the prompt and turn in the summary); the batch keeps every trajectory;
* ``--env-reward`` takes the verifier's reward, the environment's, or both.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from replayrl.rollout.dispatch.engine_actor import EngineActor
from replayrl.rollout.dispatch.manager import RolloutManager
from replayrl.rollout.tasks.calculator import DigitCalculatorEnv
from replayrl.rollout.tasks.environment import Step
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import engine_kwargs, run_required_traces, write_initial_checkpoint
from replayrl.transport.array_bundle import pack_arrays

WEIGHTS = pack_arrays({"w": np.zeros(3, np.float32)})
GROUPS, N = 2, 2


class CrashOnSecondGroup(DigitCalculatorEnv):
    """The digit calculator, raising on the tool calls of prompt row index 1 of the batch's
    first draw (whichever prompt has dataset index ``BAD_INDEX``)."""

    BAD_INDEX: int = -1

    async def reset(self, prompt):
        self.bad = prompt.index == self.BAD_INDEX
        await super().reset(prompt)

    async def step(self, turn):
        if self.bad:
            raise RuntimeError("calculator down")
        return await super().step(turn)


class PaysPerCall(DigitCalculatorEnv):
    """The digit calculator with step reward 0.25 per tool call."""

    async def step(self, turn):
        step = await super().step(turn)
        return Step(step.observation, 0.25 if step.observation is not None else 0.0, step.done)


async def _rollout(tmp_path, **flags):
    config = build_config({"rollout-max-turns": 3, "rollout-batch-size": GROUPS,
                           "n-samples-per-prompt": N, "progress": False,
                           "output-dir": str(tmp_path), **flags})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    model, required = config.policy_config, run_required_traces(config)
    engine = EngineActor("tests.fake_engine:ToolCallingEngine", engine_kwargs(config), required)
    await engine.load_weights(0, WEIGHTS)
    manager = RolloutManager(config.rollout.to_dict(), ["engine_0"], required,
                             model.max_position_embeddings, str(checkpoint), model.vocab_size)
    manager.proxy = lambda name, timeout=None: engine
    summary = await manager.generate(0, min_version=0)
    return summary, manager.batches[0]


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
        assert (x.reward, x.status, x.group_id) == (y.reward, y.status, y.group_id)


async def test_the_digit_calculator_behind_the_interface_gives_the_built_in_trajectories(tmp_path):
    built_in, samples = await _rollout(tmp_path / "a")
    via_env, env_samples = await _rollout(tmp_path / "b", env="digit_calculator")
    _same(samples, env_samples)
    # the tool call, "= d", then the answer d <eos>: reward 1 for every trajectory by hand
    assert all(s.loss_mask.tolist() == [1, 0, 0, 1, 1] and s.reward == 1.0 for s in samples)
    assert via_env["env_failures"] == 0 and via_env["env_failure_messages"] == []
    assert "env_failures" not in built_in
    for key in ("reward_mean", "tool_calls_mean", "response_len_mean", "truncated_fraction",
                "turns_mean", "final_answer_accuracy"):
        assert built_in[key] == via_env[key]
    # per episode, by hand: two turns, every answer right; a parser only with --env
    assert (via_env["turns_mean"], via_env["final_answer_accuracy"]) == (2.0, 1.0)
    assert via_env["parse_errors_mean"] == 0.0 and "parse_errors_mean" not in built_in


async def test_a_raising_environment_aborts_its_own_trajectories_only(tmp_path, monkeypatch):
    first, _ = await _rollout(tmp_path / "a")
    bad = first["prompt_indices"][1]
    monkeypatch.setattr(CrashOnSecondGroup, "BAD_INDEX", bad)
    summary, samples = await _rollout(
        tmp_path / "b", env="tests.unit.rollout.test_env_manager:CrashOnSecondGroup")
    assert len(samples) == GROUPS * N
    aborted = [s for s in samples if s.status == "aborted"]
    assert len(aborted) == N and summary["env_failures"] == N
    # N trajectories of one turn (aborted, verifier reward 0), the others two turns, right
    assert summary["turns_mean"] == (N * 1 + N * 2) / (2 * N)
    assert summary["final_answer_accuracy"] == 0.5
    for s in aborted:  # one turn (the tool call), no observation, verifier reward 0
        assert s.loss_mask.tolist() == [1] and s.reward == 0.0
    for s in samples:
        if s.status != "aborted":
            assert s.loss_mask.tolist() == [1, 0, 0, 1, 1] and s.reward == 1.0
    for message in summary["env_failure_messages"]:
        assert "(row " in message and "turn 0: raised: RuntimeError: calculator down" in message
        assert "CrashOnSecondGroup" in message and "at prompt " in message


async def test_an_environment_failure_under_env_failure_error_ends_the_rollout(tmp_path, monkeypatch):
    from replayrl.rollout.errors import EnvironmentFailure
    monkeypatch.setattr(CrashOnSecondGroup, "BAD_INDEX", -1)
    monkeypatch.setattr(CrashOnSecondGroup, "step",
                        lambda self, turn: (_ for _ in ()).throw(RuntimeError("down")))
    with pytest.raises(EnvironmentFailure, match="turn 0: raised: RuntimeError: down"):
        await _rollout(tmp_path, env="tests.unit.rollout.test_env_manager:CrashOnSecondGroup",
                       **{"env-failure": "error"})


@pytest.mark.parametrize("source, expected", [("verifier", 1.0), ("env", 0.25), ("sum", 1.25)])
async def test_env_reward_chooses_the_reward(tmp_path, source, expected):
    summary, samples = await _rollout(tmp_path, env="tests.unit.rollout.test_env_manager:PaysPerCall",
                                      **{"env-reward": source})
    assert [s.reward for s in samples] == [expected] * (GROUPS * N)


def test_the_run_configuration_checks_env():
    from replayrl.tools.run.config import ConfigError
    with pytest.raises(ConfigError, match=r"--env 'nope': not a registered environment "
                                          r"\(digit_calculator, python_calculator, retrieval\)"):
        build_config({"env": "nope", "progress": False})
    with pytest.raises(ConfigError, match="--env replayrl.rollout.tasks.calculator:DigitToolEnv: "
                                          ".* is not a replayrl.rollout.tasks.environment"):
        build_config({"env": "replayrl.rollout.tasks.calculator:DigitToolEnv", "progress": False})
    build_config({"env": "retrieval", "rollout-max-turns": 3, "apply-chat-template": True,
                  "progress": False})


OPENING = [{"role": "system", "content": "cite the passage"}]


def _retrieval_with_opening():
    from replayrl.rollout.tasks import load_environment_class
    from replayrl.rollout.tasks.environment import Reset

    class RetrievalWithOpening(load_environment_class("retrieval")):
        async def reset(self, prompt):
            return Reset(observation=OPENING)
    return RetrievalWithOpening


@pytest.mark.parametrize("opening", [False, True])
async def test_with_a_chat_template_the_trained_ids_are_the_ids_every_engine_call_saw(
        tmp_path, monkeypatch, opening):
    """The retrieval example through the manager: the fake engine writes a Hermes tool call,
    then the answer; every engine call's context, and every stored trajectory (its prompt ids
    included), is transformers' rendering of the conversation (the template puts "\\n" after
    <|im_end|>). With ``opening``, the environment's reset opens the episode with a system
    message, which the first call sees and the sample's prompt ids hold."""
    import dataclasses
    import json

    from replayrl.rollout.config import RolloutConfig
    from replayrl.rollout.model.config import default_config
    from replayrl.rollout.tasks import load_environment_class
    from replayrl.rollout.text.tokenizer import load_tokenizer
    from tests.unit.rollout.test_env_interface import TOOLS_TEMPLATE, _ids, _make_tokenizer

    tokdir = _make_tokenizer(tmp_path, "tok", TOOLS_TEMPLATE, ["<|im_start|>", "<|im_end|>"],
                             "<|im_end|>")
    env_cls = load_environment_class("retrieval")
    tok = load_tokenizer(tokdir, apply_chat_template=True, tools=env_cls.tools)
    question = "what is the capital of Australia?"
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"prompt": question, "label": "Canberra"}) + "\n")
    call = '<tool_call>{"name": "search", "arguments": {"query": "capital of Australia"}}</tool_call>'
    eot = tok.eos_token_id
    turns = [_ids(tok, call) + [eot], _ids(tok, "Canberra") + [eot]]
    first = [{"role": "user", "content": question}] + (OPENING if opening else [])
    prompt_ids = _ids(tok, tok.tokenizer.apply_chat_template(
        first, tools=list(env_cls.tools), tokenize=False, add_generation_prompt=True))
    env = "retrieval"
    if opening:
        monkeypatch.setattr(sys.modules[__name__], "RetrievalWithOpening", _retrieval_with_opening(),
                            raising=False)
        env = f"{__name__}:RetrievalWithOpening"
    config = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_turns=3,
                           max_response_len=200, prompt_data=str(data), rm_type="exact",
                           apply_chat_template=True, env=env, top_k=-1,
                           eval_prompt_data=("held", str(data)), n_samples_per_eval_prompt=3)
    model = dataclasses.asdict(default_config(12))
    engine = EngineActor("tests.fake_engine:ScriptedTurnsEngine",
                         {"model_config": model, "turns": turns, "base": prompt_ids.count(eot)}, [])
    await engine.load_weights(0, WEIGHTS)
    seen = []

    class Recording:
        def __getattr__(self, method):
            return getattr(engine, method)

        async def generate(self, prompts, *args, **kwargs):
            seen.extend(p.tolist() for p in prompts)
            return await engine.generate(prompts, *args, **kwargs)

    manager = RolloutManager(config.to_dict(), ["engine_0"], [], 4096, str(tokdir), 1000)
    manager.proxy = lambda name, timeout=None: Recording()
    summary = await manager.generate(0, min_version=0)
    samples = manager.batches[0]

    tool_text = "\n".join(sys.modules[env_cls.__module__].index().search("capital of Australia"))
    assert tool_text.startswith("Canberra is the capital city of Australia.")
    messages = first + [{"role": "assistant", "content": call},
                        {"role": "tool", "content": tool_text},
                        {"role": "assistant", "content": "Canberra"}]
    n = len(first)

    def whole(msgs, **kw):
        return _ids(tok, tok.tokenizer.apply_chat_template(msgs, tools=list(env_cls.tools),
                                                           tokenize=False, **kw))

    assert seen == [whole(messages[:n], add_generation_prompt=True)] * 2 + \
        [whole(messages[:n + 2], add_generation_prompt=True)] * 2
    full = whole(messages)
    assert summary["env_failures"] == 0 and summary["reward_mean"] == 1.0
    for s in samples:
        assert s.prompt_ids.tolist() == prompt_ids
        trained = s.prompt_ids.tolist() + s.response_ids.tolist()
        assert trained == full[:-1] and full[-1:] == _ids(tok, "\n")
        for context in seen:
            assert trained[:len(context)] == context
        n0, n1 = len(turns[0]), len(turns[1])
        assert s.loss_mask.tolist() == [1] * n0 + [0] * (len(s.loss_mask) - n0 - n1) + [1] * n1
        assert s.status == "completed" and s.reward == 1.0

    # the evaluation runs the same episodes with the environment: 3 samples, each engine
    # call's context the rendered conversation so far; by hand: 2 turns, 1 tool call, right
    seen.clear()
    evaluation = await manager.evaluate(1, min_version=0)
    assert seen == [whole(messages[:n], add_generation_prompt=True)] * 3 + \
        [whole(messages[:n + 2], add_generation_prompt=True)] * 3
    assert {k: v for k, v in evaluation.items() if k != "eval_seconds"} == {
        "eval/held/reward_mean": 1.0, "eval/held/pass@1": 1.0, "eval/held/pass@3": 1.0,
        "eval/held/turns_mean": 2.0, "eval/held/tool_calls_mean": 1.0,
        "eval/held/parse_errors_mean": 0.0}
