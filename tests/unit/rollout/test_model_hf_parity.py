"""The embedded model computes what transformers' Qwen3MoeForCausalLM computes on the same checkpoint.

The reference is transformers itself, loaded with `from_pretrained` from the directory written by
`replayrl.rollout.model.checkpoint.save_pretrained` (indexer off, fp32, eager attention).
"""

import dataclasses

import pytest
import torch

from replayrl.rollout.model import default_config
from replayrl.rollout.model.checkpoint import save_pretrained
from tests.model_helpers import decisive_model

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: the HF parity reference is unavailable")

VOCAB = ["<pad>", "<bos>", "<eos>"] + [f"w{i}" for i in range(29)]
ATOL = 1e-5


def _model(cfg, seed):
    return decisive_model(cfg, seed, norm_jitter=0.2)


def _hf(model, tmp_path):
    save_pretrained(model, tmp_path, VOCAB)
    # No dtype argument: its name changed between transformers 4 and 5; both load fp32 here.
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert hf.dtype == torch.float32
    return hf.eval()


CONFIGS = {
    # The embedded default with the indexer off: layer 0 dense, 1-3 MoE, top-2 renormalised.
    "default": dataclasses.replace(default_config(len(VOCAB)), index_topk=0),
    # decoder_sparse_step rule (layers 1, 3 MoE), no renormalisation, 4:1 GQA, top-3.
    "sparse_step": dataclasses.replace(
        default_config(len(VOCAB)), index_topk=0, mlp_only_layers=(), decoder_sparse_step=2,
        norm_topk_prob=False, num_key_value_heads=1, num_experts_per_tok=3, rope_theta=500.0),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    cfg = CONFIGS[name]
    model = _model(cfg, seed=3)
    hf = _hf(model, tmp_path)
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == [
        "Qwen3MoeSparseMoeBlock" if i in cfg.moe_layers else "Qwen3MoeMLP" for i in range(4)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=g)
    pos = torch.arange(17).expand(3, 17)
    with torch.no_grad():
        ours = model(ids, pos).logits
        ref = hf(input_ids=ids, position_ids=pos).logits
    assert ref.abs().max() > 1.0  # not a near-zero comparison
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_left_padded_rows_match_transformers(tmp_path):
    cfg = CONFIGS["default"]
    model = _model(cfg, seed=5)
    hf = _hf(model, tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (2, 10), generator=g)
    real = torch.ones(2, 10, dtype=torch.bool)
    real[0, :4] = False  # row 0: 4 pad tokens on the left
    ids[0, :4] = 0
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = model(ids, pos, key_padding_mask=real).logits
        ref = hf(input_ids=ids, attention_mask=real.long(), position_ids=pos).logits
    torch.testing.assert_close(ours[real], ref[real], atol=ATOL, rtol=0)
    assert torch.isfinite(ours).all()
