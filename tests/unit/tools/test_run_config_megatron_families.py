"""--train-backend megatron with a family checkpoint, checked before any process starts: the
MLA families are accepted (megatron-core's MLA, and its DSA on DeepSeek-V3.2 / GLM-5;
docs/megatron.md), a
config.json field the mapping does not compute, a layout that does not divide the model and the
other families are refused, each message naming the field, flag or what is not built."""
from __future__ import annotations

import pytest

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from tests.family_checkpoints import tiny_hf_checkpoint


def _config(tmp_path, family: str, flags: dict | None = None, **overrides):
    tiny_hf_checkpoint(family, tmp_path / "ckpt", **overrides)
    return build_config({"hf-checkpoint": str(tmp_path / "ckpt"), "train-backend": "megatron",
                         "device": "cpu", "output-dir": str(tmp_path / "run"), **(flags or {})})


@pytest.mark.parametrize("family,overrides", [("glm4_moe_lite", {}),
                                              ("deepseek_v3", {"num_nextn_predict_layers": 0}),
                                              ("deepseek_v32", {}), ("glm_moe_dsa", {})])
def test_mla_families_are_accepted(tmp_path, family, overrides):
    config = _config(tmp_path, family, **overrides)
    assert config.trainer.train_backend == "megatron"
    assert config.policy_config.family == family


@pytest.mark.parametrize("flags", [{"pp-size": 2}, {"cp-size": 2}])
def test_mla_families_train_over_pipeline_stages_and_context_parallel_ranks(tmp_path, flags):
    # PP 2 and CP 2 give the one-rank values (tests/system/test_megatron_backend.py)
    config = _config(tmp_path, "glm4_moe_lite", flags, num_hidden_layers=4)
    assert config.trainer.rank_count == 2


@pytest.mark.parametrize("overrides,flags,message", [
    ({"rope_interleave": False}, {}, "rope_interleave false"),
    ({"norm_topk_prob": False}, {}, "norm_topk_prob false"),
    ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, {},
     r"num_experts_per_tok / topk_group = 2 / 2 != 2"),
    ({}, {"ep-size": 16, "dp-size": 16}, r"n_routed_experts=8 is not a multiple of --ep-size 16"),
    ({}, {"tp-size": 3}, r"config.json vocab_size=97 is not a multiple of --tp-size 3"),
    ({}, {"pp-size": 2}, r"--pp-size 2 must divide the policy's 3 layers"),
])
def test_what_the_mapping_does_not_compute_is_refused(tmp_path, overrides, flags, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, "glm4_moe_lite", flags, **overrides)


def test_other_families_are_refused_naming_what_is_not_built(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot train the 'gpt_oss' family .* yet: attention "
                                          r"sinks"):
        _config(tmp_path, "gpt_oss")


def test_a_qwen3_moe_checkpoint_is_accepted_as_the_embedded_model(tmp_path):
    # transformers' own qwen3_moe checkpoint: its megatron logits equal transformers'
    # (tests/system/test_megatron_family.py)
    config = _config(tmp_path, "qwen3_moe", {"tp-size": 2}, vocab_size=96)
    assert not hasattr(config.policy_config, "family")
    assert config.trainer.rank_count == 2


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_5_moe_text"])
def test_gated_deltanet_families_are_refused_naming_what_fails(tmp_path, family):
    with pytest.raises(ConfigError, match=rf"cannot train the '{family}' family .* yet: its gated "
                                          r"DeltaNet layers \(megatron-core's GatedDeltaNet raises "
                                          r"ImportError .* flash-linear-attention"):
        _config(tmp_path, family)


def test_dsa_under_context_parallelism_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--cp-size 2: context parallelism is not offered for "
                                          r"the 'deepseek_v32' family \(megatron-core's DSAttention"):
        _config(tmp_path, "deepseek_v32", {"cp-size": 2, "dp-size": 2})


def test_the_indexer_loss_flag_needs_the_megatron_trainer(tmp_path):
    config = _config(tmp_path, "glm_moe_dsa", {"dsa-indexer-loss-coeff": 0.5})
    assert config.trainer.dsa_indexer_loss_coeff == 0.5
    with pytest.raises(ConfigError, match=r"--dsa-indexer-loss-coeff needs --train-backend megatron"):
        _config(tmp_path, "glm_moe_dsa", {"dsa-indexer-loss-coeff": 0.5, "train-backend": "torch"})


def test_a_pipeline_stage_may_not_start_on_a_shared_dsa_layer(tmp_path):
    kinds = ["full", "full", "shared", "full"]  # stage 2 would start on layer 2: shared
    with pytest.raises(ConfigError, match=r"--pp-size 2: layer 2 starts a pipeline stage but has "
                                          r"no indexer"):
        _config(tmp_path, "glm_moe_dsa", {"pp-size": 2}, num_hidden_layers=4, indexer_types=kinds)
    config = _config(tmp_path / "ok", "glm_moe_dsa", {"pp-size": 2}, num_hidden_layers=4,
                     indexer_types=["full", "shared", "full", "shared"])
    assert config.trainer.pp_size == 2
