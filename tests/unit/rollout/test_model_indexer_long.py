"""Indexed layers on long rows: the top-k by `torch.topk` and attention over gathered keys.

From `GATHER_MIN_KEYS_PER_PICK * index_topk` key slots on, an indexed layer attends over the
kept keys gathered per query (rollout/model/indexer.py `gathered_attention`) instead of a dense
`[B, S, T]` mask. Checked against the naive float64 reference of test_model_indexer.py (written
from the formulas, one token and head at a time) and against masked attention written here.
"""

import numpy as np
import torch

from replayrl.rollout.model import default_config
from replayrl.rollout.model.indexer import gathered_attention, select_topk
from replayrl.rollout.model.qwen3_moe import GATHER_MIN_KEYS_PER_PICK
from tests.unit.rollout.test_model_indexer import V, _model, reference


def test_long_rows_match_the_naive_reference_with_padding():
    model = _model(default_config(V), seed=11)
    cfg = model.config
    S = GATHER_MIN_KEYS_PER_PICK * cfg.index_topk + 9  # the gathered path, with 4 pad slots
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(3))
    real = torch.ones(2, S, dtype=torch.bool)
    real[0, :4] = False  # left padding: padding queries keep no key and attend to themselves
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, pos, key_padding_mask=real, capture=True)
    for row, pad in ((0, 4), (1, 0)):
        logits, experts, slots = reference(model, ids[row, pad:].numpy())
        got = out.indexer_topk[row, pad:].numpy()
        assert np.array_equal(np.where(got >= 0, got - pad, -1), slots)
        assert np.array_equal(out.routed_experts[row, pad:].numpy(), experts)
        np.testing.assert_allclose(out.logits[row, pad:].numpy(), logits, atol=2e-5, rtol=0)
    assert (out.indexer_topk[0, :4] == -1).all() and torch.isfinite(out.logits).all()


def test_long_rows_replay_and_gradients_equal_the_short_path():
    # the same row forwarded once on the gathered path and once, via a lower threshold, on the
    # masked dense path: equal logits, traces and gradients up to float32 rounding
    import replayrl.rollout.model.qwen3_moe as qm

    model = _model(default_config(V), seed=12)
    S = GATHER_MIN_KEYS_PER_PICK * model.config.index_topk + 5
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        replay = model(ids, torch.arange(S)[None], capture=True).indexer_topk.flip(-1)  # same sets
    results = []
    for threshold in (GATHER_MIN_KEYS_PER_PICK, 10 ** 6):
        qm.GATHER_MIN_KEYS_PER_PICK, saved = threshold, qm.GATHER_MIN_KEYS_PER_PICK
        try:
            model.zero_grad(set_to_none=True)
            out = model(ids, torch.arange(S)[None], indexer_topk=replay, capture=True)
            (out.logits.float() * torch.linspace(-1, 1, V)).sum().backward()
        finally:
            qm.GATHER_MIN_KEYS_PER_PICK = saved
        results.append((out.logits.detach(), out.indexer_topk,
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, t0, g0), (l1, t1, g1) = results
    assert torch.equal(t0, t1) and torch.equal(t0, replay)
    assert torch.allclose(l0, l1, atol=1e-5)
    assert g0.keys() == g1.keys()
    for name in g0:  # float32 sums in another order: relative to the tensor's largest entry
        scale = float(g0[name].abs().max())
        assert torch.allclose(g0[name], g1[name], atol=1e-5 * scale, rtol=0), name


def test_gathered_attention_equals_masked_softmax_by_hand():
    g = torch.Generator().manual_seed(0)
    b, h_kv, group, d, t, s = 2, 2, 2, 4, 9, 6
    q = torch.randn(b, h_kv * group, s, d, generator=g)
    k, v = torch.randn(b, h_kv, t, d, generator=g), torch.randn(b, h_kv, t, d, generator=g)
    own = torch.arange(t - s, t)
    slots = torch.randint(-1, t - s + 1, (b, s, 3), generator=g)
    slots[0, 1] = torch.tensor([2, 2, -1])  # a slot listed twice counts once
    slots[1, 2] = -1  # no key kept: the query attends to its own slot
    got = gathered_attention(q, k, v, slots, own, 0.5).double()
    for bi in range(b):
        for hh in range(h_kv * group):
            for i in range(s):
                keys = sorted({int(j) for j in slots[bi, i] if j >= 0}) or [int(own[i])]
                z = torch.stack([q[bi, hh, i].double() @ k[bi, hh // group, j].double() * 0.5 for j in keys])
                p = torch.softmax(z, 0)
                want = sum(p[n] * v[bi, hh // group, j].double() for n, j in enumerate(keys))
                assert torch.allclose(got[bi, hh, i], want, atol=1e-5)


def test_gathered_attention_reads_a_kv_buffer_slice_in_place():
    # a KV cache's keys are a slice of a buffer with spare slots (append_along): gathered from
    # the buffer's rows without copying the cache, with the values of the contiguous keys
    from replayrl.rollout.model.indexer import _slot_rows

    g = torch.Generator().manual_seed(2)
    b, h_kv, d, t, spare = 3, 2, 8, 40, 24
    buffer_k = torch.randn(b, h_kv, t + spare, d, generator=g)
    buffer_v = torch.randn(b, h_kv, t + spare, d, generator=g)
    k, v = buffer_k[:, :, :t], buffer_v[:, :, :t]
    rows, stride = _slot_rows(k)
    assert rows.data_ptr() == buffer_k.data_ptr() and stride == t + spare
    assert torch.equal(rows[(1 * h_kv + 1) * stride + 7], k[1, 1, 7])
    q = torch.randn(b, 2 * h_kv, 1, d, generator=g)
    slots = torch.randint(0, t, (b, 1, 8), generator=g)
    own = torch.tensor([t - 1])
    assert torch.equal(gathered_attention(q, k, v, slots, own, 0.3),
                       gathered_attention(q, k.contiguous(), v.contiguous(), slots, own, 0.3))


def test_cached_decode_on_the_gathered_path_matches_the_naive_reference():
    # the engine's layout: prefill, then one token per step through the KV cache; once the
    # cache holds GATHER_MIN_KEYS_PER_PICK * index_topk slots the indexed layers gather
    model = _model(default_config(V), seed=13)
    n = GATHER_MIN_KEYS_PER_PICK * model.config.index_topk - 3
    seq = torch.randint(0, V, (n + 8,), generator=torch.Generator().manual_seed(6))
    cache = model.new_kv_cache()
    with torch.no_grad():
        out = [model(seq[None, :n], torch.arange(n)[None], kv_cache=cache, capture=True)]
        for i in range(n, n + 8):
            out.append(model(seq[None, i:i + 1], torch.tensor([[i]]), kv_cache=cache, capture=True))
    logits = torch.cat([o.logits for o in out], dim=1)[0]
    slots = torch.cat([o.indexer_topk for o in out], dim=1)[0]
    want_logits, _, want_slots = reference(model, seq.numpy())
    assert np.array_equal(slots.numpy(), want_slots)
    np.testing.assert_allclose(logits.numpy(), want_logits, atol=2e-5, rtol=0)


def test_topk_selection_ranks_by_score_then_the_later_slot():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 5, 12, generator=g).round()  # many ties, and -0.0 against 0.0
    scores[0, 0, :6] = -0.0
    candidates = torch.rand(3, 5, 12, generator=g) < 0.8
    got = select_topk(scores, candidates, 8)
    for bi in range(3):
        for i in range(5):
            ranked = sorted((j for j in range(12) if candidates[bi, i, j]),
                            key=lambda j: (-float(scores[bi, i, j]), -j))[:8]
            assert got[bi, i].tolist() == ranked + [-1] * (8 - len(ranked))


def test_packed_tree_rows_forwarded_per_block_equal_each_branch_alone():
    # a prefix-tree row (trainer/batching/prefix_tree.py) long enough for the per-block path
    # (BLOCK_MIN_SLOTS): trunk of P slots (segment -1), n branches of L slots after it; each
    # branch forwarded alone after the trunk is the reference (no segments, no blocks)
    from replayrl.rollout.model.qwen3_moe import BLOCK_MIN_SLOTS, _key_blocks

    model = _model(default_config(V), seed=13)
    P, L, n = 40, 64, 4
    assert P + n * L >= BLOCK_MIN_SLOTS
    g = torch.Generator().manual_seed(7)
    trunk, branches = torch.randint(0, V, (P,), generator=g), torch.randint(0, V, (n, L), generator=g)
    ids = torch.cat([trunk, branches.reshape(-1)])[None]
    pos = torch.cat([torch.arange(P), (P + torch.arange(L)).repeat(n)])[None]
    seg = torch.cat([torch.full((P,), -1), torch.arange(n).repeat_interleave(L)])[None]
    real = torch.ones_like(ids, dtype=torch.bool)
    real[0, -5:] = False  # the last branch is shorter: padding at the row's end
    seen = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril() & (
        (seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == -1))
    blocks = _key_blocks(seg, seen)
    assert blocks is not None and len(blocks) == n  # trunk + branch 0, then one per branch
    model.zero_grad(set_to_none=True)
    out = model(ids, pos, key_padding_mask=real, segment_ids=seg, capture=True)
    (out.logits * real[..., None]).sum().backward()
    got_grad = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for j in range(n):
        ids_j = torch.cat([trunk, branches[j]])[None]
        real_j = torch.ones_like(ids_j, dtype=torch.bool)
        if j == n - 1:
            real_j[0, -5:] = False
        ref = model(ids_j, torch.arange(P + L)[None], key_padding_mask=real_j, capture=True)
        (ref.logits * real_j[..., None]).sum().backward()
        span = slice(P + j * L, P + (j + 1) * L)
        keep = real_j[0, P:]
        torch.testing.assert_close(out.logits[0, span][keep], ref.logits[0, P:][keep], atol=2e-5, rtol=0)
        slots = out.own_indexer_topk[0, span][keep].long()
        mapped = torch.where(slots >= P, slots - j * L, slots)  # tree slot -> the branch's own slot
        assert torch.equal(mapped, ref.own_indexer_topk[0, P:][keep].long())
        assert torch.equal(out.routed_experts[0, span][keep], ref.routed_experts[0, P:][keep])
        if j == 0:
            torch.testing.assert_close(out.logits[0, :P], ref.logits[0, :P], atol=2e-5, rtol=0)
            assert torch.equal(out.own_indexer_topk[0, :P], ref.own_indexer_topk[0, :P])
    # the trunk's logits count once in the tree and once per branch alone: taking (n - 1)
    # trunk-alone passes off the accumulated per-branch gradients leaves the tree's
    model(trunk[None], torch.arange(P)[None]).logits.sum().mul(-(n - 1)).backward()
    for name, p in model.named_parameters():
        if name in got_grad:
            scale = float(got_grad[name].abs().max())
            torch.testing.assert_close(got_grad[name], p.grad, atol=2e-5 * scale, rtol=0)
    model.zero_grad(set_to_none=True)
