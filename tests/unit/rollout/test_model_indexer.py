"""Indexer selection, trace shapes and the whole forward against a naive float64 numpy loop.

The reference below is written from the formulas (docs/design/model.md#embedded-default,
rollout/model/indexer.py docstring, HF Qwen3-MoE math), one token and one head at a time,
independently of the model code.
"""

import numpy as np
import pytest
import torch

from replayrl.rollout.model import ModelInputError, default_config
from tests.model_helpers import decisive_model

V = 32


def _model(cfg, seed):
    return decisive_model(cfg, seed, norm_jitter=0.2)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos * inv
    c, s = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * c + rot * s


def _silu(x):
    return x / (1 + np.exp(-x))


def reference(model, ids, expert_replay=None, slot_replay=None):
    """Naive float64 forward of one unpadded sequence (positions 0..S-1).

    Returns logits [S, V], experts [S, L_moe, K], slots [S, L_idx, index_topk] (-1 = none).
    Replays: arrays of the same shapes; a row of only -1 keeps the model's own choice.
    """
    cfg = model.config
    W = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    S, nh, nkv, d = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = W["model.embed_tokens.weight"][ids]
    experts_out, slots_out = [], []
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        x = _rms(h, W[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = (x @ W[p + "self_attn.q_proj.weight"].T).reshape(S, nh, d)
        k = (x @ W[p + "self_attn.k_proj.weight"].T).reshape(S, nkv, d)
        v = (x @ W[p + "self_attn.v_proj.weight"].T).reshape(S, nkv, d)
        q = _rms(q, W[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = _rms(k, W[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
        q = np.stack([_rope(q[i], i, cfg.rope_theta) for i in range(S)])
        k = np.stack([_rope(k[i], i, cfg.rope_theta) for i in range(S)])
        keys_of = [list(range(i + 1)) for i in range(S)]
        if layer in cfg.indexed_layers:
            li = cfg.indexed_layers.index(layer)
            nih, dih, topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
            iq = (x @ W[p + "self_attn.indexer.wq.weight"].T).reshape(S, nih, dih)
            ik = x @ W[p + "self_attn.indexer.wk.weight"].T
            iw = x @ W[p + "self_attn.indexer.weights_proj.weight"].T
            rows = np.full((S, topk), -1)
            for i in range(S):
                score = {j: sum(iw[i, hh] * max(0.0, iq[i, hh] @ ik[j]) for hh in range(nih))
                         for j in range(i + 1)}
                ranked = sorted(score, key=lambda j: (-score[j], -j))[:topk]  # ties: recent first
                rows[i, : len(ranked)] = ranked
                if slot_replay is not None and (slot_replay[i, li] >= 0).any():
                    rows[i] = slot_replay[i, li]
                keys_of[i] = [j for j in rows[i] if j >= 0]
            slots_out.append(rows)
        att = np.zeros((S, nh, d))
        for i in range(S):
            for hh in range(nh):
                kv = hh // (nh // nkv)
                js = keys_of[i]
                logit = np.array([q[i, hh] @ k[j, kv] for j in js]) / np.sqrt(d)
                w = np.exp(logit - logit.max())
                w /= w.sum()
                att[i, hh] = sum(wj * v[j, kv] for wj, j in zip(w, js))
        h = h + att.reshape(S, nh * d) @ W[p + "self_attn.o_proj.weight"].T
        x = _rms(h, W[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        if layer in cfg.moe_layers:
            lm = cfg.moe_layers.index(layer)
            K = cfg.num_experts_per_tok
            logits = x @ W[p + "mlp.gate.weight"].T
            prob = np.exp(logits - logits.max(-1, keepdims=True))
            prob /= prob.sum(-1, keepdims=True)
            chosen = np.argsort(-prob, axis=-1, kind="stable")[:, :K]
            if expert_replay is not None:
                keep = (expert_replay[:, lm] < 0).all(-1, keepdims=True)
                chosen = np.where(keep, chosen, expert_replay[:, lm])
            out = np.zeros_like(x)
            for i in range(S):
                w = prob[i, chosen[i]]
                if cfg.norm_topk_prob:
                    w = w / w.sum()
                for e, we in zip(chosen[i], w):
                    e = f"{p}mlp.experts.{e}."
                    hidden = _silu(x[i] @ W[e + "gate_proj.weight"].T) * (x[i] @ W[e + "up_proj.weight"].T)
                    out[i] += we * hidden @ W[e + "down_proj.weight"].T
            experts_out.append(chosen)
        else:
            hidden = _silu(x @ W[p + "mlp.gate_proj.weight"].T) * (x @ W[p + "mlp.up_proj.weight"].T)
            out = hidden @ W[p + "mlp.down_proj.weight"].T
        h = h + out
    h = _rms(h, W["model.norm.weight"], cfg.rms_norm_eps)
    return h @ W["lm_head.weight"].T, np.stack(experts_out, 1), np.stack(slots_out, 1)


@pytest.fixture(scope="module")
def model():
    return _model(default_config(V), seed=11)


def test_forward_matches_naive_reference_with_indexer(model):
    cfg = model.config
    assert cfg.indexed_layers == (1, 3) and cfg.index_topk == 8
    ids = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(ids[None], torch.arange(20)[None], capture=True)
    logits, experts, slots = reference(model, ids.numpy())
    assert np.array_equal(out.routed_experts[0].numpy(), experts)
    assert np.array_equal(out.indexer_topk[0].numpy(), slots)
    # Sequences longer than index_topk really are sparse: late queries drop keys.
    assert (slots[10:] >= 0).sum(-1).max() == cfg.index_topk
    np.testing.assert_allclose(out.logits[0].numpy(), logits, atol=2e-5, rtol=0)


def test_traces_shapes_dtypes_and_causality(model):
    cfg = model.config
    B, S = 3, 13
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4))
    real = torch.ones(B, S, dtype=torch.bool)
    real[1, :5] = False  # left padding
    real[2, 9:] = False  # right padding
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, pos, key_padding_mask=real, capture=True)
    assert out.routed_experts.dtype == torch.int32 and out.indexer_topk.dtype == torch.int32
    assert out.routed_experts.shape == (B, S, 3, 2)
    assert out.indexer_topk.shape == (B, S, 2, 8)
    assert out.hidden is None
    slots = out.indexer_topk.numpy()
    for b in range(B):
        for i in range(S):
            for li in range(2):
                row = slots[b, i, li]
                picked = row[row >= 0]
                assert (row[len(picked):] == -1).all()  # -1 only as trailing fill
                if not real[b, i]:
                    assert len(picked) == 0  # padding queries pick nothing
                    continue
                n_causal = int(real[b, : i + 1].sum())
                assert len(picked) == min(n_causal, cfg.index_topk)
                assert len(set(picked.tolist())) == len(picked)
                assert all(j <= i and real[b, j] for j in picked)
    e = out.routed_experts.numpy()
    assert e.min() >= 0 and e.max() < cfg.num_experts
    assert (np.sort(e, -1)[..., 1:] != np.sort(e, -1)[..., :-1]).all()


def test_padded_rows_give_the_same_traces_as_unpadded(model):
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(6))
    real = torch.ones(2, 11, dtype=torch.bool)
    real[0, :3] = False
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, pos, key_padding_mask=real, capture=True, return_hidden=True)
    logits, experts, slots = reference(model, ids[0, 3:].numpy())
    got = out.indexer_topk[0, 3:].numpy()
    assert np.array_equal(np.where(got >= 0, got - 3, -1), slots)  # slot - pad count = position
    assert np.array_equal(out.routed_experts[0, 3:].numpy(), experts)
    np.testing.assert_allclose(out.logits[0, 3:].numpy(), logits, atol=2e-5, rtol=0)
    assert out.hidden.shape == (2, 11, model.config.hidden_size)
    assert torch.isfinite(out.logits).all()


def test_indexer_gets_no_gradient(model):
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(8))
    model.zero_grad(set_to_none=True)
    model(ids, torch.arange(12)[None]).logits.square().mean().backward()
    for name, p in model.named_parameters():
        if ".indexer." in name:
            assert not p.requires_grad and p.grad is None, name
        elif ".mlp.experts." not in name:  # an expert no token was routed to has no gradient
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad(set_to_none=True)


def test_bad_indexer_replay_is_rejected(model):
    ids = torch.zeros(1, 4, dtype=torch.long)
    pos = torch.arange(4)[None]
    bad = torch.full((1, 4, 2, 8), -1, dtype=torch.int32)
    bad[0, 1, 0, 0] = 3  # query 1 may not see key slot 3
    with pytest.raises(ModelInputError, match="non-causal"):
        model(ids, pos, indexer_topk=bad)
    with pytest.raises(ModelInputError, match="indexer_topk"):
        model(ids, pos, indexer_topk=bad[..., :4])
    bad[0, 1, 0, 0] = 4  # out of range
    with pytest.raises(ModelInputError, match=r"\[-1, 4\)"):
        model(ids, pos, indexer_topk=bad)
