"""ModelConfig: HF layer-kind rule, config.json round trip, validation, default size."""

import dataclasses

import pytest

from replayrl.rollout.model import ModelConfig, ModelConfigError, Qwen3MoeForCausalLM, default_config


def test_default_config_values():
    cfg = default_config(43)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim,
            cfg.num_key_value_heads) == (128, 4, 4, 32, 2)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.intermediate_size) == (8, 2, 64, 256)
    assert cfg.moe_layers == (1, 2, 3)  # layer 0 dense via mlp_only_layers
    assert cfg.indexed_layers == (1, 3) and cfg.index_topk == 8
    assert cfg.max_position_embeddings == 256 and not cfg.tie_word_embeddings


def test_default_parameter_count_by_hand():
    v, h = 43, 128
    attn = 2 * h * 128 + 2 * h * 64 + 2 * 32 + 2 * h  # q, o; k, v; q/k norm; two layer norms
    dense = 3 * h * 256
    moe = 8 * h + 8 * 3 * h * 64
    indexer = 32 * h + 16 * h + 2 * h
    expected = 2 * v * h + h + 4 * attn + dense + 3 * moe + 2 * indexer
    model = Qwen3MoeForCausalLM(default_config(v))
    assert sum(p.numel() for p in model.parameters()) == expected == 913_024


@pytest.mark.parametrize("step, mlp_only, expected", [
    (1, (), (0, 1, 2, 3, 4, 5)),
    (2, (), (1, 3, 5)),
    (3, (), (2, 5)),
    (1, (0, 4), (1, 2, 3, 5)),
    (2, (1,), (3, 5)),
])
def test_moe_layers_follow_hf_rule(step, mlp_only, expected):
    cfg = dataclasses.replace(default_config(10), num_hidden_layers=6, decoder_sparse_step=step,
                              mlp_only_layers=mlp_only, index_layers=(1,))
    assert cfg.moe_layers == expected


def test_no_experts_means_no_moe_layers_and_indexer_off_means_no_indexed_layers():
    cfg = dataclasses.replace(default_config(10), num_experts=0, index_topk=0)
    assert cfg.moe_layers == () and cfg.indexed_layers == ()


def test_hf_dict_round_trip():
    cfg = dataclasses.replace(default_config(10), index_layers=(3, 1), mlp_only_layers=(0, 2))
    d = cfg.to_hf_dict(torch_dtype="bfloat16")
    assert d["architectures"] == ["Qwen3MoeForCausalLM"] and d["model_type"] == "qwen3_moe"
    assert d["torch_dtype"] == "bfloat16" and d["mlp_only_layers"] == [0, 2]
    assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert ModelConfig.from_hf_dict(d) == cfg
    assert cfg.indexed_layers == (1, 3)


def test_from_hf_dict_reads_transformers5_rope_and_defaults():
    d = default_config(10).to_hf_dict()
    del d["rope_theta"], d["head_dim"], d["mlp_only_layers"], d["replayrl_indexer"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_theta == 1e6 and cfg.head_dim == 128 // 4
    assert cfg.mlp_only_layers == () and cfg.index_topk == 0 and cfg.indexed_layers == ()


@pytest.mark.parametrize("edit, message", [
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
     r"'rope_scaling.rope_type'='dynamic' is not supported"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_from_hf_dict_rejects_unsupported(edit, message):
    d = {**default_config(10).to_hf_dict(), **edit}
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_from_hf_dict_names_missing_key():
    d = default_config(10).to_hf_dict()
    del d["num_experts_per_tok"]
    with pytest.raises(ModelConfigError, match="'num_experts_per_tok'"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("change, field", [
    ({"num_key_value_heads": 3}, "num_attention_heads"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"index_layers": (4,)}, "index_layers"),
    ({"mlp_only_layers": (0, 0)}, "mlp_only_layers"),
    ({"index_n_heads": 0}, "index_topk"),
    ({"head_dim": 31}, "head_dim"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_invalid_config_names_the_field(change, field):
    with pytest.raises(ModelConfigError, match=field):
        dataclasses.replace(default_config(10), **change)


def test_an_unknown_model_type_is_refused_naming_every_loadable_one():
    # a user with a checkpoint of another model_type learns every model_type --hf-checkpoint
    # takes: the embedded model's two and each registered family (listed here by hand)
    d = {**default_config(10).to_hf_dict(), "model_type": "deepseek_v4"}
    with pytest.raises(ModelConfigError) as caught:
        ModelConfig.from_hf_dict(d)
    for model_type in ("qwen3", "qwen3_moe", "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "gpt_oss"):
        assert model_type in str(caught.value)
