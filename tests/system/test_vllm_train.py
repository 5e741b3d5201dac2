"""A short training run with ``--rollout-engine vllm`` through the real multi-process system
(skipped where vllm is not installed; CI runs it in its own venv, see .ci/run)."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("vllm")

from replayrl.tools.run.from_flags import build_config  # noqa: E402
from replayrl.tools.run.launcher import launch  # noqa: E402


async def test_twenty_steps_on_vllm_learn_with_zero_routing_flips(tmp_path):
    config = build_config({"rollout-engine": "vllm", "model-indexer": False, "num-steps": 20,
                           "engine-dtype": "float32", "seed": 1, "progress": False,
                           "output-dir": str(tmp_path)})
    result = await launch(config)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(20))
    # R3 replays vLLM's routing: the trainer's router never disagrees with it
    assert all(r["routing_flip_rate"] == 0.0 for r in rows)
    # step 0 is generated and trained at the same version, both fp32: vLLM's sampled logprobs
    # equal the trainer's replayed ones within fp32 kernel rounding
    assert rows[0]["staleness_max"] == 0 and rows[0]["train_rollout_logprob_abs_diff"] < 1e-5
    reward = np.array([r["reward_mean"] for r in rows])
    assert reward[-5:].mean() > 1.5 * reward[:5].mean()  # seed 1: 0.05 -> 0.16


async def test_dist_pushes_reach_vllm_whole(tmp_path):
    """``--weight-sync dist``: the engine actor that hosts vLLM joins the weight group,
    receives each push's buckets and loads them through vLLM's in-place reload (as a zmq
    push). Synchronous steps (each rollout generated from the push just made) in fp32: every
    step's sampled logprobs equal the trainer's replayed ones within fp32 rounding, which
    they would not with any weight of the push missing or wrong."""
    config = build_config({"rollout-engine": "vllm", "model-indexer": False, "num-steps": 3,
                           "max-staleness": 0, "weight-sync": "dist", "engine-dtype": "float32",
                           "seed": 1, "progress": False, "output-dir": str(tmp_path)})
    result = await launch(config)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["trainer_version"] for r in rows] == [1, 2, 3]
    assert all(r["staleness_max"] == 0 for r in rows)
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in rows)
