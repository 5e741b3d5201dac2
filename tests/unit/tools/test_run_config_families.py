"""A family checkpoint (rollout/model/families/) refuses, before any process starts, what its
transformers model cannot run: another engine or trainer backend, several trainer ranks,
packing; the message names the flag and the family."""
from __future__ import annotations

import pytest

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import engine_kwargs
from tests.family_checkpoints import tiny_hf_checkpoint


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss")
    tiny_hf_checkpoint("gpt_oss", d)
    return d


@pytest.mark.parametrize("flag,value,message", [
    ("rollout-engine", "vllm", "--rollout-engine vllm cannot serve the 'gpt_oss' family"),
    ("dp-size", 2, "the 'gpt_oss' family trains on one rank"),
    ("train-backend", "megatron", "--train-backend megatron cannot train the 'gpt_oss' family"),
    ("use-packing", True, "--use-packing: the 'gpt_oss' family model has no packed segments"),
])
def test_family_refuses_what_it_cannot_run_before_start(gpt_oss_dir, tmp_path, flag, value,
                                                        message):
    with pytest.raises(ConfigError, match=message):
        build_config({"hf-checkpoint": str(gpt_oss_dir), flag: value,
                      "output-dir": str(tmp_path / "run")})


def test_family_shape_reaches_the_engines(gpt_oss_dir, tmp_path):
    config = build_config({"hf-checkpoint": str(gpt_oss_dir), "output-dir": str(tmp_path)})
    shape = engine_kwargs(config)["model_config"]
    assert shape["family"] == "gpt_oss" and list(shape["moe_layers"]) == [0, 1, 2]
    assert config.trainer.use_indexer_replay is False  # gpt-oss has no indexer
