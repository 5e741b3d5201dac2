"""The two example environments end to end: ``replayrl train`` with a real tokenizer and a
Hermes / Qwen-style chat template (examples/environments/make_checkpoint.py), a tiny random
Qwen3-MoE checkpoint, ``--rollout-max-turns 2`` and the format-credit reward
(examples/environments/format_credit.py). A few steps each; the training tables are in
docs/benchmarks.md (Tool environments). A system test: the run starts its actor processes.
"""
from __future__ import annotations

import importlib.util
import json

import pytest

from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import launch
from tests.paths import REPO

EXAMPLES = REPO / "examples" / "environments"
# format credit (0, 0.25, 0.5) + exact match of the final answer (0, 1): the module docstring
REWARDS = {0.0, 0.25, 0.5, 1.0, 1.25, 1.5}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_checkpoint", EXAMPLES / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("env_ckpt")
    module.main(out)
    return out


@pytest.mark.parametrize("env, prompts", [("CalculatorWithFormatCredit", "calculator_prompts.jsonl"),
                                          ("RetrievalWithFormatCredit", "retrieval_prompts.jsonl")])
async def test_a_few_multi_turn_steps_on_each_example_environment(tmp_path, checkpoint, env, prompts):
    config = build_config({
        "hf-checkpoint": str(checkpoint), "env": f"{EXAMPLES / 'format_credit.py'}:{env}",
        "env-reward": "sum", "rm-type": "exact", "apply-chat-template": True,
        "rollout-max-turns": 2, "rollout-max-response-len": 16,
        "prompt-data": str(EXAMPLES / prompts), "rollout-batch-size": 2,
        "n-samples-per-prompt": 4, "num-steps": 2, "seed": 1, "progress": False,
        "output-dir": str(tmp_path / "run")})
    result = await launch(config)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["samples"] == 8 and r["env_failures"] == 0 and r["env_failure_messages"] == []
        assert 0.0 <= r["reward_mean"] <= r["reward_max"] and r["reward_max"] in REWARDS
        # rewards are multiples of 0.25: the mean of 8 of them is a multiple of 1/32
        assert r["reward_mean"] * 32 == pytest.approx(round(r["reward_mean"] * 32))
        assert r["tool_calls_mean"] >= 0.0 and r["response_len_mean"] > 0

