"""Checkpoint directories and weight pushes: bitwise round trips and typed errors."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from replayrl.rollout.model import CheckpointError, Qwen3MoeForCausalLM, default_config
from replayrl.rollout.model.checkpoint import load_state_arrays, save_pretrained, state_dict_arrays
from replayrl.rollout.model.loader import load_pretrained

VOCAB = ["<pad>", "<bos>", "<eos>", "1", "2", "3", "+", "=", "yes", "no"]


def _model(seed=0, dtype=torch.float32):
    m = Qwen3MoeForCausalLM(default_config(len(VOCAB)))
    m.init_weights(seed)
    return m.to(dtype)


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def test_save_load_round_trip_is_bitwise(tmp_path):
    model = _model(seed=1)
    save_pretrained(model, tmp_path, VOCAB)
    assert {p.name for p in tmp_path.iterdir()} == {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json"}
    loaded, cfg = load_pretrained(tmp_path)
    assert cfg == model.config
    _assert_same_weights(model, loaded)
    ids = torch.tensor([[1, 3, 6, 4, 7]])
    pos = torch.arange(5)[None]
    with torch.no_grad():
        assert torch.equal(model(ids, pos).logits, loaded(ids, pos).logits)


def test_checkpoint_files_use_hf_names_and_config(tmp_path):
    save_pretrained(_model(), tmp_path, VOCAB)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["model_type"] == "qwen3_moe"
    assert hf["torch_dtype"] == "float32"
    assert hf["replayrl_indexer"] == {"index_topk": 8, "index_n_heads": 2, "index_head_dim": 16,
                                      "index_layers": [1, 3]}
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (1, 2, 0)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert shapes["model.embed_tokens.weight"] == (10, 128)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (256, 128)
    assert shapes["model.layers.1.mlp.gate.weight"] == (8, 128)
    assert shapes["model.layers.1.mlp.experts.7.down_proj.weight"] == (128, 64)
    assert shapes["model.layers.2.self_attn.q_proj.weight"] == (128, 128)
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (64, 128)
    assert shapes["model.layers.2.self_attn.q_norm.weight"] == (32,)
    assert shapes["model.layers.3.self_attn.indexer.wq.weight"] == (32, 128)
    assert shapes["model.layers.3.self_attn.indexer.wk.weight"] == (16, 128)
    assert shapes["model.layers.3.self_attn.indexer.weights_proj.weight"] == (2, 128)
    assert "model.layers.2.self_attn.indexer.wq.weight" not in shapes
    assert shapes["lm_head.weight"] == (10, 128) and shapes["model.norm.weight"] == (128,)


def test_tokenizer_is_word_level_over_the_given_vocabulary(tmp_path):
    from tokenizers import Tokenizer

    save_pretrained(_model(), tmp_path, VOCAB)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.encode("<bos> 1 + 2 = 3 <eos>").ids == [1, 3, 6, 4, 7, 5, 2]
    assert tok.decode([3, 6, 4], skip_special_tokens=True) == "1 + 2"
    with pytest.raises(Exception):  # noqa: B017  (tokenizers raises its own untyped error)
        tok.encode("1 + 4")  # unknown word: no silent <unk>
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<bos>", "<eos>", "<pad>")
    assert "chat_template" not in cfg


def test_bf16_checkpoint_round_trip(tmp_path):
    model = _model(seed=2, dtype=torch.bfloat16)
    save_pretrained(model, tmp_path, VOCAB)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded, _ = load_pretrained(tmp_path, dtype=torch.bfloat16)
    _assert_same_weights(model, loaded)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"),
     "missing key 'model.layers.2.mlp.experts.5.up_proj.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(8, 128)}),
     "unexpected key 'model.layers.0.mlp.gate.weight'"),
    (lambda t: t.update({"model.norm.weight": torch.ones(64)}),
     r"shape mismatch for 'model.norm.weight': model \[128\], found \[64\]"),
])
def test_bad_checkpoint_raises_checkpoint_error(tmp_path, edit, message):
    save_pretrained(_model(), tmp_path, VOCAB)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(tmp_path)


def test_missing_weights_file_raises_checkpoint_error(tmp_path):
    save_pretrained(_model(), tmp_path, VOCAB)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("tokens, message", [
    (VOCAB[:-1], "9 entries"),
    (VOCAB[:-1] + ["1"], "repeats '1'"),
    (["<unk>"] + VOCAB[1:], "'<pad>'"),
    (VOCAB[:-1] + ["a b"], "whitespace"),
])
def test_bad_vocabulary_is_rejected(tmp_path, tokens, message):
    with pytest.raises(CheckpointError, match=message):
        save_pretrained(_model(), tmp_path, tokens)


def test_weight_push_round_trip_fp32_to_bf16():
    trainer = _model(seed=3)
    arrays = state_dict_arrays(trainer)
    assert all(a.dtype == np.float32 and not a.flags.writeable for a in arrays.values())
    with torch.no_grad():
        trainer.lm_head.weight.add_(1.0)  # the push is a copy, not a view of live weights
    assert not np.array_equal(arrays["lm_head.weight"], trainer.lm_head.weight.detach().numpy())

    engine = _model(seed=4, dtype=torch.bfloat16)
    load_state_arrays(engine, arrays)
    for name, p in engine.state_dict().items():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, torch.from_numpy(arrays[name].copy()).to(torch.bfloat16)), name

    fp32 = _model(seed=5)
    load_state_arrays(fp32, arrays)
    for name, p in fp32.state_dict().items():
        assert np.array_equal(p.numpy(), arrays[name]), name
    # bf16 -> float32 arrays is exact widening.
    back = state_dict_arrays(engine)
    assert all(np.array_equal(back[n], engine.state_dict()[n].float().numpy()) for n in back)


def test_bad_weight_push_raises_and_changes_nothing():
    model = _model(seed=6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    arrays = dict(state_dict_arrays(_model(seed=7)))
    arrays.pop("model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(CheckpointError, match="missing key 'model.layers.1.self_attn.k_norm.weight'"):
        load_state_arrays(model, arrays)
    arrays = dict(state_dict_arrays(_model(seed=7)))
    arrays["lm_head.weight"] = arrays["lm_head.weight"].astype(np.int32)
    with pytest.raises(CheckpointError, match="'lm_head.weight'"):
        load_state_arrays(model, arrays)
    arrays["lm_head.weight"] = np.zeros((3, 128), np.float32)
    with pytest.raises(CheckpointError, match="shape mismatch for 'lm_head.weight'"):
        load_state_arrays(model, arrays)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
