"""Multi-turn tool use (rollout/tasks/calculator.py, rollout/episodes/turn_loop.py) on the embedded default.

The independent end-to-end check: for every generated multi-turn trajectory, ONE fp32 forward
of prompt + response (the trainer's view, observations included) replaying the returned
routed_experts / indexer_topk must reproduce, at every loss-bearing row, the engine's logprob
through the support replay ``z_y - logsumexp_{v in S} z_v`` (written out in float64 numpy).
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.episodes.env_sessions import EnvSessions
from replayrl.rollout.episodes.turn_loop import assemble, run_episodes, turn_seed
from replayrl.rollout.errors import MissingTraceError, MixedVersionError, ToolEnvError, TurnLoopError
from replayrl.rollout.model.checkpoint import state_dict_arrays
from replayrl.rollout.model.config import default_config
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sample import TRACE_FIELDS, Sample
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.rollout.tasks.calculator import DigitToolEnv
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY, DigitTask
from replayrl.rollout.text.data_source import Prompt
from tests.paths import CASES

CASES = {c["name"]: c for c in json.loads((CASES / "trace_alignment.json").read_text())}
TASK = DigitTask()
ID = {t: i for i, t in enumerate(VOCABULARY)}
PARAMS = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)
MAX_TURNS, MAX_NEW = 3, 3


def tokens(text: str) -> list[int]:
    return [ID[t] for t in text.split()]


# ------------------------------------------------------------------------------ tool env


def test_tool_env_answers_operator_calls_by_hand():
    env = DigitToolEnv()
    prompt = tokens("<bos> max 3 1 4 2 =")
    assert env.observe(prompt, tokens("min a <eos>")).tolist() == tokens("= 1")
    assert env.observe(prompt, tokens("max")).tolist() == tokens("= 4")
    assert env.observe(prompt, tokens("first 7")).tolist() == tokens("= 3")
    assert env.observe(prompt, tokens("last")).tolist() == tokens("= 2")
    assert env.observe(prompt, tokens("4 <eos>")) is None
    assert env.observe(prompt, tokens("a max")) is None  # only a leading operator calls the tool
    with pytest.raises(ToolEnvError):
        env.observe(tokens("<bos> max 3 x ="), tokens("max"))


def test_tool_env_rewards_the_final_segment():
    env = DigitToolEnv()
    answer = ID["4"]
    # "max = 4 4 <eos>": tool call, observation, exact final answer -> 1.0
    assert env.reward(tokens("max = 4 4 <eos>"), [1, 0, 0, 1, 1], answer) == 1.0
    # final answer 3 without <eos>: 0.5 ** 1 * 0.5
    assert env.reward(tokens("max = 4 3 a"), [1, 0, 0, 1, 1], answer) == 0.25
    # the trajectory ended on a tool call: no answer
    assert env.reward(tokens("min = 1 max"), [1, 0, 0, 1], answer) == 0.0
    assert env.reward(tokens("4 <eos>"), [1, 1], answer) == 1.0


@pytest.mark.parametrize("response, expected", [
    ("4 <eos>", 1.0),        # exact digit, stops right after it
    ("3 <eos>", 0.5),        # 0.5 ** |3 - 4|
    ("3 a", 0.25),           # 0.5 ** 1, halved: no <eos> after the digit
    ("2", 0.125),            # 0.5 ** 2, halved
    ("4 <eos> a", 0.5),      # exact, but more than "digit <eos>": halved
    ("max 4 <eos>", 0.0),    # a leading operator is no answer (single-turn: no tool either)
    ("a 4 <eos>", 0.0),
])
def test_one_verifier_scores_single_turn_responses_like_the_task(response, expected):
    """The manager scores every trajectory with DigitToolEnv.reward; with a single turn (loss mask
    all ones) it must give exactly the task's reward of the whole response (hand-computed)."""
    ids = np.asarray(tokens(response), dtype=np.int32)
    answer = ID["4"]
    assert TASK.reward(ids, answer) == expected
    assert DigitToolEnv(TASK).reward(ids, np.ones(len(ids), np.uint8), answer) == expected


# ------------------------------------------------------------------------------ end to end


CALCULATOR = DigitToolEnv()


def task_sessions(env, prompts):
    """The turn loop's sessions of the task environment ``env`` over prompt ids ``prompts``."""
    records = [Prompt(i, np.asarray(p, np.int32), -1) for i, p in enumerate(prompts)]
    return EnvSessions.of_task(env, records)


def generate(engine, prompts, *, max_turns, max_new_tokens, seed, traces=TRACE_FIELDS,
             env=CALCULATOR):
    """The manager's path without actors: the turn loop on ``engine``, then ``assemble``."""

    async def generate_turn(contexts, turn_seed):
        return engine.generate(contexts, PARAMS, max_new_tokens=max_new_tokens,
                               eos_token_id=TASK.eos_id, seed=turn_seed, traces=traces), engine.version

    episodes = asyncio.run(run_episodes(generate_turn, prompts, max_turns=max_turns,
                                        max_new_tokens=max_new_tokens,
                                        max_positions=engine.config.max_position_embeddings,
                                        seed=seed,
                                        env=task_sessions(env, prompts) if env is not None else None))
    outs = []
    for i, e in enumerate(episodes):
        merged, version = assemble(e, sample_id=i, require=traces)
        outs.append({**merged.sample_fields(), "finish_reason": e.finish_reason,
                     "num_turns": merged.num_turns, "num_tool_calls": e.num_tool_calls,
                     "version": version})
    return outs


@pytest.fixture(scope="module")
def setup():
    cfg = default_config(len(VOCABULARY))
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(3)
    model.eval()
    engine = EmbeddedEngine(cfg, dtype=torch.float32)
    engine.load_weights(state_dict_arrays(model), version=0)
    rng = np.random.default_rng(0)
    prompts = [TASK.make_prompt(rng)[0] for _ in range(16)]
    outs = generate(engine, prompts, max_turns=MAX_TURNS, max_new_tokens=MAX_NEW, seed=1)
    return cfg, model, engine, prompts, outs


def observation_runs(loss_mask):
    """(start, end) of every maximal run of loss_mask 0."""
    runs, start = [], None
    for j, m in enumerate(list(loss_mask) + [1]):
        if m == 0 and start is None:
            start = j
        elif m == 1 and start is not None:
            runs.append((start, j))
            start = None
    return runs


def test_multi_turn_shapes_and_observations(setup):
    cfg, _, _, prompts, outs = setup
    assert len(outs) == len(prompts)
    assert sum(o["num_turns"] > 1 for o in outs) >= 2  # the seed gives real multi-turn samples
    for prompt, o in zip(prompts, outs):
        P, R = len(prompt), len(o["response_ids"])
        assert o["loss_mask"].shape == o["rollout_logprobs"].shape == (R,)
        assert o["sample_support"].shape == (R, 1 + PARAMS.top_k)
        assert o["routed_experts"].shape == (P + R - 1, len(cfg.moe_layers), cfg.num_experts_per_tok)
        assert o["indexer_topk"].shape == (P + R - 1, len(cfg.indexed_layers), cfg.index_topk)
        obs = o["loss_mask"] == 0
        assert (o["sample_support"][obs] == -1).all()
        assert (o["rollout_logprobs"][obs] == 0.0).all()
        assert (o["sample_support"][~obs, 0] == o["response_ids"][~obs]).all()
        # Each observation is "= d" for the operator that opened the turn before it.
        runs = observation_runs(o["loss_mask"])
        assert len(runs) == o["num_turns"] - 1
        turn_start = 0
        digits = [int(VOCABULARY[t]) for t in prompt[2:-1]]
        for a, b in runs:
            op = VOCABULARY[o["response_ids"][turn_start]]
            value = {"max": max(digits), "min": min(digits), "first": digits[0], "last": digits[-1]}[op]
            assert o["response_ids"][a:b].tolist() == tokens(f"= {value}")
            turn_start = b
        assert o["num_tool_calls"] in (o["num_turns"] - 1, o["num_turns"])
        assert o["finish_reason"] in ("stop", "length", "max_turns")
        if o["finish_reason"] == "max_turns":
            assert o["num_turns"] == MAX_TURNS and o["num_tool_calls"] == MAX_TURNS
        Sample(sample_id=0, group_id=0, rollout_id=0, policy_version=0, prompt_ids=prompt,
               **{k: o[k] for k in ("response_ids", "loss_mask", "rollout_logprobs",
                                    "sample_support", "routed_experts", "indexer_topk")})


def test_multi_turn_observation_rows(setup):
    """Case multi_turn_observation_rows on the real generator: support rows = R, -1 observation rows."""
    case = CASES["multi_turn_observation_rows"]
    _, _, _, _, outs = setup
    multi = [o for o in outs if o["num_turns"] > 1]
    for o in multi:
        assert o["sample_support"].shape[0] == len(o["loss_mask"])
        assert (o["sample_support"][o["loss_mask"] == 0] == -1).all()
    assert case["expected_observation_rows_all_minus_one"]


def test_one_full_forward_with_replay_reproduces_rollout_logprobs(setup):
    cfg, model, _, prompts, outs = setup
    checked = 0
    for prompt, o in zip(prompts, outs):
        P = len(prompt)
        response = o["response_ids"]
        ids = torch.tensor([list(prompt) + response[:-1].tolist()])
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        routed = torch.from_numpy(np.array(o["routed_experts"]))[None]
        keys = torch.from_numpy(np.array(o["indexer_topk"]))[None]
        with torch.no_grad():
            out = model(ids, pos, routed_experts=routed, indexer_topk=keys, capture=True)
        # Every row is what an unreplayed fp32 forward picks at that position, so the rows
        # are aligned to the right positions (a shifted row would pick other experts).
        assert torch.equal(out.own_routed_experts, routed)
        assert torch.equal(out.own_indexer_topk, keys)
        logits = out.logits[0, P - 1:].double().numpy() / PARAMS.temperature
        for j in np.flatnonzero(o["loss_mask"] == 1):
            z = logits[j]
            support = [v for v in o["sample_support"][j, 1:] if v != -1]
            m = max(z[v] for v in support)
            expected = z[response[j]] - (m + np.log(sum(np.exp(z[v] - m) for v in support)))
            assert abs(o["rollout_logprobs"][j] - expected) < 1e-4, (j, o["rollout_logprobs"][j], expected)
            checked += 1
    assert checked > 3 * len(prompts)


def test_same_seed_same_trajectories(setup):
    _, _, engine, prompts, outs = setup
    again = generate(engine, prompts, max_turns=MAX_TURNS, max_new_tokens=MAX_NEW, seed=1)
    for a, b in zip(outs, again):
        for k in ("response_ids", "loss_mask", "rollout_logprobs", "sample_support", "routed_experts",
                  "indexer_topk", "finish_reason", "num_turns"):
            assert np.array_equal(a[k], b[k]), k


def test_turn_budget_ends_on_tool_calls(setup):
    _, _, engine, prompts, outs = setup
    one = generate(engine, prompts, max_turns=2, max_new_tokens=MAX_NEW, seed=1)
    assert {o["num_turns"] for o in one} == {1, 2}
    # Turns 0 and 1 use the same engine seeds as in the 3-turn run, so they match it.
    for a, b in zip(one, outs):
        assert np.array_equal(a["response_ids"], b["response_ids"][:len(a["response_ids"])])
        # a tool call in the last allowed turn ends the trajectory without an observation
        assert (a["finish_reason"] == "max_turns") == (a["num_tool_calls"] == 2)
        assert a["num_tool_calls"] >= a["num_turns"] - 1


def test_single_turn_is_the_loop_without_tools_at_the_plain_seed(setup):
    """max_turns 1: no environment, the engine seed is the run seed itself (not turn_seed)."""
    _, _, engine, prompts, _ = setup
    one = generate(engine, prompts, max_turns=1, max_new_tokens=MAX_NEW, seed=1, env=None)
    direct = engine.generate(prompts, PARAMS, max_new_tokens=MAX_NEW, eos_token_id=TASK.eos_id,
                             seed=1, traces=TRACE_FIELDS)
    for o, g in zip(one, direct):
        assert np.array_equal(o["response_ids"], g.response_ids)
        assert (o["loss_mask"] == 1).all() and o["num_tool_calls"] == 0
        assert o["finish_reason"] == g.finish_reason  # a leading operator is no tool call here
    assert turn_seed(1, 0, 1) == 1 and turn_seed(1, 0, 3) != 1


def test_capture_off_gives_no_per_position_traces(setup):
    cfg, model, engine, prompts, _ = setup
    outs = generate(engine, prompts[:4], max_turns=2, max_new_tokens=2, seed=1,
                    traces=("sample_support",))
    assert all(o["routed_experts"] is None and o["indexer_topk"] is None for o in outs)
    assert all(o["sample_support"].shape[0] == len(o["response_ids"]) for o in outs)


def test_required_trace_not_captured_is_an_error(setup):
    _, _, engine, prompts, _ = setup

    async def generate_turn(contexts, seed):
        return engine.generate(contexts, PARAMS, max_new_tokens=2, eos_token_id=TASK.eos_id,
                               seed=seed, traces=("sample_support",)), 0

    episodes = asyncio.run(run_episodes(generate_turn, prompts[:1], max_turns=1, max_new_tokens=2,
                                        max_positions=64, seed=0, env=None))
    with pytest.raises(MissingTraceError, match="sample 7: field 'routed_experts'"):
        assemble(episodes[0], sample_id=7, require=TRACE_FIELDS)


def test_turns_from_two_weight_versions_are_refused(setup):
    _, _, engine, prompts, _ = setup
    versions = iter([4, 5, 5])

    async def generate_turn(contexts, seed):  # a weight push lands between turn 0 and turn 1
        return engine.generate(contexts, PARAMS, max_new_tokens=MAX_NEW, eos_token_id=TASK.eos_id,
                               seed=seed, traces=TRACE_FIELDS), next(versions)

    episodes = asyncio.run(run_episodes(generate_turn, prompts, max_turns=MAX_TURNS,
                                        max_new_tokens=MAX_NEW, max_positions=64, seed=1,
                                        env=task_sessions(DigitToolEnv(), prompts)))
    multi = next(i for i, e in enumerate(episodes) if len(e.turns) > 1)
    single = next(i for i, e in enumerate(episodes) if len(e.turns) == 1)
    assert assemble(episodes[single], sample_id=single, require=TRACE_FIELDS)[1] == 4
    with pytest.raises(MixedVersionError, match=r"sample 99: field 'policy_version'.*\[4, 5"):
        assemble(episodes[multi], sample_id=99, require=TRACE_FIELDS)


@pytest.mark.parametrize("kwargs", [{"max_turns": 0}, {"max_new_tokens": 0}, {"seed": -1},
                                    {"max_turns": 2.0}, {"max_positions": 0}])
def test_argument_errors(kwargs):
    async def generate_turn(contexts, seed):
        raise AssertionError("never called")

    args = {"max_turns": 2, "max_new_tokens": 2, "max_positions": 64, "seed": 0, "env": None,
            **kwargs}
    with pytest.raises(TurnLoopError, match=next(iter(kwargs))):
        asyncio.run(run_episodes(generate_turn, [[1, 2]], **args))
