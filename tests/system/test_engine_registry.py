"""The engine room: registry, resolution in the launcher, and one real step on a fake engine."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from replayrl.rollout.engines import ENGINES, engine_class_path, load_engine_class
from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.errors import EngineError, UnknownEngine
from replayrl.rollout.model.config import default_config
from replayrl.rollout.sample import required_traces
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY, DigitTask
from replayrl.rollout.tasks.digits import digit_task_prompts
from replayrl.rollout.text.data_source import PromptDataSource
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import engine_kwargs, launch, resolve_engine
from tests.paths import REPO

SMALL = {"rollout-batch-size": 4, "n-samples-per-prompt": 4, "progress": False}
FAKE = "tests.fake_engine:FixedDigitEngine"


def test_registry_resolves_names_lazily_and_refuses_unknown_ones():
    assert engine_class_path("embedded") == "replayrl.rollout.engines.embedded:EmbeddedEngine"
    assert load_engine_class(engine_class_path("embedded")) is EmbeddedEngine
    with pytest.raises(UnknownEngine, match=r"unknown rollout engine 'trtllm'; known engines: "
                                            r"embedded, sglang, vllm"):
        engine_class_path("trtllm")
    with pytest.raises(EngineError, match="not a replayrl.rollout.engines.base.Engine subclass"):
        load_engine_class("replayrl.rollout.tasks.digit_puzzle:DigitTask")


def test_required_traces_follow_flags_and_model_layers():
    cfg = default_config(len(VOCABULARY))
    assert cfg.moe_layers and cfg.indexed_layers  # the embedded policy has both
    on = dict(support_replay=True, routing_replay=True, indexer_replay=True)
    assert required_traces(cfg, **on) == ("sample_support", "routed_experts", "indexer_topk")
    assert required_traces(cfg, **{**on, "routing_replay": False}) == ("sample_support", "indexer_topk")
    assert required_traces(cfg, **{**on, "support_replay": False, "indexer_replay": False}) == (
        "routed_experts",)
    dense = dataclasses.replace(cfg, mlp_only_layers=tuple(range(cfg.num_hidden_layers)))
    assert dense.moe_layers == ()
    assert required_traces(dense, **on) == ("sample_support", "indexer_topk")


async def test_unknown_or_unfit_engine_is_a_config_error_before_any_process(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"--rollout-engine trtllm: unknown rollout engine "
                                          r"'trtllm'; known engines: embedded, sglang, vllm"):
        await launch(build_config({**SMALL, "num-steps": 1, "output-dir": str(out),
                                   "rollout-engine": "trtllm"}))
    assert not out.exists()  # nothing written, nothing started
    monkeypatch.setitem(ENGINES, "no-routing", "tests.fake_engine:NoRoutingEngine")
    with pytest.raises(ConfigError, match=r"NoRoutingEngine cannot capture trace 'routed_experts'"):
        await launch(build_config({**SMALL, "num-steps": 1, "output-dir": str(out),
                                   "rollout-engine": "no-routing"}))
    assert not out.exists()
    # without R3 the run requires nothing it cannot capture
    config = build_config({**SMALL, "rollout-engine": "no-routing", "use-routing-replay": False})
    assert resolve_engine(config) == "tests.fake_engine:NoRoutingEngine"


def test_vllm_is_imported_only_when_its_engine_is_built_and_refuses_the_indexer():
    # a fresh interpreter: importing the registry and the engine class pulls in no vllm
    code = ("import sys; from replayrl.rollout.engines import load_engine_class, engine_class_path; "
            "cls = load_engine_class(engine_class_path('vllm')); "
            "print(cls.__name__, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO)
    assert out.stdout.split() == ["VllmEngine", "False"]
    # the default policy has the indexer: refused before any process starts, with the way out
    with pytest.raises(ConfigError, match=r"VllmEngine cannot serve a model with the "
                                          r"sparse-attention indexer \(layers \[1, 3\]\).*"
                                          r"--no-model-indexer"):
        resolve_engine(build_config({**SMALL, "rollout-engine": "vllm",
                                     "use-indexer-replay": False}))
    with pytest.raises(ConfigError, match=r"VllmEngine cannot capture trace 'indexer_topk'"):
        resolve_engine(build_config({**SMALL, "rollout-engine": "vllm"}))
    free = build_config({**SMALL, "rollout-engine": "vllm", "model-indexer": False})
    assert free.policy_config.indexed_layers == () and free.policy_config.moe_layers == (1, 2, 3)
    assert resolve_engine(free) == "replayrl.rollout.engines.vllm_engine:VllmEngine"
    assert engine_kwargs(free)["call_timeout_s"] == free.rollout.generate_timeout_s


def _hand_reward(guess: int, answer: int) -> float:
    return 0.5 ** abs(guess - answer)  # each answer is "digit <eos>": not halved


async def test_one_real_step_on_a_registered_fake_engine(tmp_path, monkeypatch):
    monkeypatch.setitem(ENGINES, "fixed-digit", FAKE)
    config = build_config({**SMALL, "num-steps": 1, "output-dir": str(tmp_path),
                           "rollout-engine": "fixed-digit"})
    assert resolve_engine(config) == FAKE
    result = await launch(config)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    # The expected rewards, from the prompts alone: with one engine, a group's n = 4 trajectories
    # are rows 4g .. 4g+3 of the engine's single call, so two answer d1 and two answer dn.
    r = config.rollout
    data = PromptDataSource(digit_task_prompts(DigitTask(num_digits=r.num_digits,
                                                         num_values=r.num_values),
                                               r.seed, r.dataset_size), r.seed)
    prompts = data.next_batch(r.rollout_batch_size)
    assert row["prompt_indices"] == [p.index for p in prompts]
    expected = []
    for p in prompts:
        words = [VOCABULARY[t] for t in p.prompt_ids]
        digits = [int(w) for w in words[2:-1]]
        answer = {"max": max(digits), "min": min(digits), "first": digits[0],
                  "last": digits[-1]}[words[1]]
        expected += [_hand_reward(digits[0], answer), _hand_reward(digits[-1], answer)] * 2
    assert row["reward_mean"] == pytest.approx(float(np.mean(expected)), abs=1e-12)
    assert row["reward_max"] == pytest.approx(max(expected), abs=1e-12)  # the collapse watch's best
    assert row["response_len_mean"] == 2.0 and row["truncated_fraction"] == 0.0
    # samples carried the version the fake engine served (0) into a step at trainer version 0
    assert row["staleness_max"] == 0 and row["trainer_version"] == 1
    assert row["routing_flip_rate"] == 0.0 and row["indexer_flip_rate"] == 0.0


def test_sglang_needs_urls_and_each_engine_starts_on_its_own_server():
    with pytest.raises(ConfigError, match="--rollout-engine sglang needs --sglang-urls"):
        build_config({**SMALL, "rollout-engine": "sglang"})
    with pytest.raises(ConfigError, match="sglang-urls"):
        build_config({**SMALL, "rollout-engine": "sglang", "sglang-urls": "gpu1:30000"})
    with pytest.raises(ConfigError, match="only read by --rollout-engine sglang"):
        build_config({**SMALL, "sglang-urls": "http://a:1"})
    with pytest.raises(ConfigError, match="each SGLang server has one engine"):
        build_config({**SMALL, "rollout-engine": "sglang", "num-engines": 3,
                      "sglang-urls": "http://a:1,http://b:2"})
    config = build_config({**SMALL, "rollout-engine": "sglang", "num-engines": 2,
                           "sglang-urls": "http://a:1,http://b:2/,http://c:3",
                           "rollout-timeout-seconds": 90})
    kwargs = [engine_kwargs(config, i) for i in range(2)]
    assert [k["urls"] for k in kwargs] == [["http://a:1", "http://b:2", "http://c:3"],
                                           ["http://b:2", "http://c:3", "http://a:1"]]
    assert kwargs[0]["call_timeout_s"] == 30.0  # three tries fit in the manager's 90 s wait
