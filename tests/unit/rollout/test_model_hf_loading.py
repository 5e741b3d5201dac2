"""Checkpoints written by transformers' own `save_pretrained` load into the model and compute
transformers' logits: dense Qwen3 / Qwen3-MoE, tied / untied, single file / sharded, scaled RoPE,
any stored dtype. Unsupported configs and broken directories are typed errors naming the field.

The reference is transformers itself (fp32, eager attention) on the very directory loaded.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from replayrl.rollout.model import CheckpointError, ModelConfigError
from replayrl.rollout.model.hf_config import read_hf_config
from replayrl.rollout.model.loader import load_pretrained

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: the HF parity reference is unavailable")

ATOL = 1e-5
SHAPE = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1)
MOE = dict(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2)


def _write(tmp_path, kind, tied, shards, dtype=torch.float32, seed=0, **extra):
    """A random transformers model of `kind` saved by transformers into tmp_path/ckpt."""
    torch.manual_seed(seed)
    if kind == "dense":
        cfg = transformers.Qwen3Config(**SHAPE, tie_word_embeddings=tied, **extra)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(**SHAPE, **MOE, tie_word_embeddings=tied, **extra)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1, so a norm read into the wrong place shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape))
    out = tmp_path / "ckpt"
    model.to(dtype).save_pretrained(out, max_shard_size="40KB" if shards else "1GB")
    assert (out / "model.safetensors.index.json").exists() == shards
    return out


def _reference(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager")
    return hf.eval()


def _assert_logits_match(path, ids_seed=0):
    ours, cfg = load_pretrained(path)
    ref = _reference(path)
    g = torch.Generator().manual_seed(ids_seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=g)
    pos = torch.arange(40).expand(2, 40) + torch.tensor([[0], [70]])  # far positions: scaled RoPE
    with torch.no_grad():
        got = ours(ids, pos).logits
        want = ref(input_ids=ids, position_ids=pos).logits
    assert want.abs().max() > 1.0  # not a near-zero comparison
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    return ours, cfg


@pytest.mark.parametrize("kind, tied, shards", [
    ("dense", True, False), ("dense", False, True),
    ("moe", False, True), ("moe", True, False),
])
def test_transformers_checkpoint_logits_match(tmp_path, kind, tied, shards):
    extra = {} if kind == "dense" else {"mlp_only_layers": [0], "norm_topk_prob": tied}
    ours, cfg = _assert_logits_match(_write(tmp_path, kind, tied, shards, **extra))
    assert cfg.tie_word_embeddings == tied
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert cfg.moe_layers == ((1, 2) if kind == "moe" else ())
    assert cfg.indexed_layers == ()  # no indexer block in a transformers checkpoint


def test_decoder_sparse_step_and_mlp_only_layers(tmp_path):
    path = _write(tmp_path, "moe", False, True, decoder_sparse_step=2, mlp_only_layers=[2],
                  norm_topk_prob=True)
    _, cfg = _assert_logits_match(path)
    assert cfg.moe_layers == (1,)  # layer 1 by the step rule; layer 3 does not exist, 2 is dense


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
     "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
])
def test_scaled_rope_matches_transformers(tmp_path, rope):
    path = _write(tmp_path, "dense", False, False, rope_parameters={**rope, "rope_theta": 5e4})
    _, cfg = _assert_logits_match(path)
    assert dict(cfg.rope_scaling)["rope_type"] == rope["rope_type"] and cfg.rope_theta == 5e4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_loads_as_transformers_does(tmp_path, dtype):
    path = _write(tmp_path, "moe", False, True, dtype=dtype, mlp_only_layers=[0])
    stored = load_file(str(next(path.glob("model-*.safetensors"))))
    assert {t.dtype for t in stored.values()} == {dtype}
    ours, _ = _assert_logits_match(path)
    assert ours.dtype == torch.float32
    bf16, _ = load_pretrained(path, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16


def test_loaded_weights_equal_the_stored_tensors(tmp_path):
    path = _write(tmp_path, "moe", False, True, mlp_only_layers=[0])
    ours, _ = load_pretrained(path)
    stored = {}
    for shard in path.glob("model-*.safetensors"):
        stored.update(load_file(str(shard)))
    assert set(stored) == set(ours.state_dict())
    for name, t in ours.state_dict().items():
        assert torch.equal(t, stored[name]), name


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     r"config.json field 'rope_scaling.rope_type'='dynamic' is not supported"),
    (lambda d: d.update(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
     r"'rope_scaling.factor' is required"),
    (lambda d: d.update(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                         "foo": 1}), r"'rope_scaling.foo' is not supported"),
    (lambda d: d.update(use_sliding_window=True), r"'use_sliding_window'=True"),
    (lambda d: d.update(layer_types=["full_attention", "sliding_attention", "full_attention"]),
     r"'layer_types\[1\]'='sliding_attention'"),
    (lambda d: d.update(attention_bias=True), r"'attention_bias'=True"),
    (lambda d: d.update(hidden_act="gelu"), r"'hidden_act'='gelu'"),
    (lambda d: d.update(attention_dropout=0.1), r"'attention_dropout'=0.1"),
    (lambda d: d.update(partial_rotary_factor=0.5), r"'partial_rotary_factor'=0.5"),
    (lambda d: d.update(model_type="llama"), r"'model_type'='llama'"),
    (lambda d: d.update(architectures=["Qwen3ForSequenceClassification"]), r"'architectures'"),
    (lambda d: d.pop("vocab_size"), r"'vocab_size'"),
])
def test_unsupported_config_is_an_error_naming_the_field(tmp_path, edit, message):
    path = _write(tmp_path, "dense", False, False)
    d = json.loads((path / "config.json").read_text())
    edit(d)
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ModelConfigError, match=message):
        load_pretrained(path)


def test_moe_config_from_transformers_reads_num_local_experts(tmp_path):
    path = _write(tmp_path, "moe", False, False)
    d = json.loads((path / "config.json").read_text())
    assert "num_experts" not in d and d["num_local_experts"] == 6  # transformers 5 spelling
    assert read_hf_config(path).num_experts == 6


def _shard_with(path, name):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][name]


def test_index_naming_a_missing_shard(tmp_path):
    path = _write(tmp_path, "dense", False, True)
    shard = _shard_with(path, "model.norm.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"names the shard '{shard.name}'"):
        load_pretrained(path)


def test_shard_lacking_an_indexed_tensor(tmp_path):
    path = _write(tmp_path, "dense", False, True)
    shard = _shard_with(path, "model.norm.weight")
    tensors = load_file(str(shard))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="maps 'model.norm.weight'"):
        load_pretrained(path)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(4, 64)}),
     "unexpected key 'model.layers.0.mlp.gate.weight'"),
    (lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"),
     "missing key 'model.layers.2.self_attn.k_norm.weight'"),
    (lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}),
     "'model.norm.weight' is stored as I32"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(61, 64)}),
     "'lm_head.weight' differs from 'model.embed_tokens.weight'"),
])
def test_bad_single_file_checkpoint(tmp_path, change, message):
    path = _write(tmp_path, "dense", True, False)
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(path)


def test_tied_checkpoint_storing_the_same_head_loads(tmp_path):
    path = _write(tmp_path, "dense", True, False)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    _assert_logits_match(path)


def test_directory_without_safetensors(tmp_path):
    path = _write(tmp_path, "dense", False, False)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only safetensors"):
        load_pretrained(path)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_our_save_of_a_loaded_checkpoint_round_trips_through_transformers(tmp_path, kind):
    from replayrl.rollout.model.checkpoint import save_pretrained

    extra = {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}
    if kind == "moe":
        extra.update(mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True)
    path = _write(tmp_path, kind, True, True, **extra)
    ours, cfg = load_pretrained(path)
    out = save_pretrained(ours, tmp_path / "saved", tokenizer_from=path)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [{"dense": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM"}[kind]]
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))  # tied: not stored
    assert read_hf_config(out) == cfg
    _assert_logits_match(out)
