"""Replay managers: registry by global layer id, SP slicing, -1 rows, replay check and flip rate,
on hand-built arrays and on the embedded Qwen3-MoE model."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from rollout.model import Qwen3MoeForCausalLM, default_config
from trainer.replay import (
    ReplayError,
    ReplayMismatch,
    ReplayRegistry,
    check_replay,
    fill_own_choice,
    flip_rate,
    replayed_rows,
    sp_slice,
)

V = 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny model forwards: with 2 OpenMP threads on a shared 2-vCPU machine every small op
    waits at a barrier whenever a neighbour holds a core (measured 2.6-10 s vs 0.07 s for the
    -1 rows test); restored afterwards so other modules keep their setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------- registry


def _interleaved_config():
    """6 layers, dense at 0 and 3: MoE layers (1, 2, 4, 5); indexer on 2 and 5."""
    return dataclasses.replace(default_config(V), num_hidden_layers=6, mlp_only_layers=(0, 3),
                               index_layers=(2, 5))


def _tagged_trace(layers, t=4, k=2):
    """trace[t, c, j] = 1000 * global_layer + 10 * t + j: every entry names its layer and token."""
    tr = np.zeros((t, len(layers), k), np.int64)
    for c, layer in enumerate(layers):
        tr[:, c, :] = 1000 * layer + 10 * np.arange(t)[:, None] + np.arange(k)
    return tr


def test_pipeline_stages_read_their_global_columns():
    cfg = _interleaved_config()
    assert cfg.moe_layers == (1, 2, 4, 5)
    trace = _tagged_trace(cfg.moe_layers)
    stage0, stage1 = ReplayRegistry.for_routing(cfg), ReplayRegistry.for_routing(cfg)
    assert stage0.register_stage(0, 3) == (1, 2)  # layer 0 is dense: no stream
    assert stage1.register_stage(1, 3) == (4, 5)  # layer 3 is dense
    assert stage1.column(4) == 2 and stage1.column(5) == 3
    # Stage 1's first MoE layer is global layer 4 (column 2), not column 0 (construction order).
    assert (stage1.stream(trace, 4) // 1000 == 4).all()
    local = stage1.local_trace(trace)
    assert local.shape == (4, 2, 2)
    assert (local[:, 0] // 1000 == 4).all() and (local[:, 1] // 1000 == 5).all()
    tlocal = stage1.local_trace(torch.from_numpy(trace))
    assert torch.equal(tlocal, torch.from_numpy(local))
    with pytest.raises(ReplayError, match="not registered"):
        stage1.column(1)
    with pytest.raises(ReplayError, match="no trace column"):
        stage0.column(0)


def test_registration_order_and_duplicates():
    cfg = _interleaved_config()
    a, b = ReplayRegistry.for_routing(cfg), ReplayRegistry.for_routing(cfg)
    a.register([5, 2])  # e.g. an interleaved (VPP) stage built in any order
    b.register([2])
    b.register([5])
    assert a.layers == b.layers == (2, 5)
    trace = _tagged_trace(cfg.moe_layers)
    np.testing.assert_array_equal(a.local_trace(trace), b.local_trace(trace))
    with pytest.raises(ReplayError, match="registered twice"):
        a.register([2])
    with pytest.raises(ReplayError, match="registered twice"):
        ReplayRegistry.for_routing(cfg).register([1, 1])
    with pytest.raises(ReplayError, match="outside"):
        a.register([6])
    with pytest.raises(ReplayError, match="does not fit"):
        ReplayRegistry.for_routing(cfg).register_stage(2, 3)
    with pytest.raises(ReplayError, match=r"\[\.\.\., 4, K\]"):
        a.local_trace(np.zeros((4, 3, 2), np.int64))
    idx = ReplayRegistry.for_indexer(cfg)
    assert idx.register_stage(1, 3) == (5,) and idx.column(5) == 1


def test_registry_streams_are_what_each_router_picked():
    """Real model with dense layers interleaved: the stream of global layer i equals the top-k
    of layer i's router logits (read with a forward hook, independently of the trace)."""
    cfg = _interleaved_config()
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(3)
    gate_logits = {}
    for i in cfg.moe_layers:
        model.model.layers[i].mlp.gate.register_forward_hook(
            lambda mod, inp, out, i=i: gate_logits.__setitem__(i, out.detach()))
    ids = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, torch.arange(10)[None], capture=True)
    trace = out.routed_experts[0]  # [T, L_moe, K]
    for rank in (0, 1):
        reg = ReplayRegistry.for_routing(cfg)
        for layer in reg.register_stage(rank, 3):
            want = torch.topk(gate_logits[layer], cfg.num_experts_per_tok, dim=-1).indices
            got = reg.stream(trace, layer).long()
            assert torch.equal(got.sort(-1).values, want.sort(-1).values)


# ----------------------------------------------------------------- sequence parallel


@pytest.mark.parametrize("t,sp", [(8, 2), (9, 2), (10, 4), (7, 3), (5, 1)])
def test_sp_slice_matches_torch_chunk_of_activations(t, sp):
    activations = torch.arange(t, dtype=torch.float32)[:, None].expand(t, 6)
    indices = torch.arange(t)[:, None, None].expand(t, 3, 2) * 100 + torch.arange(2)
    chunks = torch.chunk(activations, sp, dim=0)
    for r, chunk in enumerate(chunks):
        rows = sp_slice(indices, r, sp)
        assert torch.equal(rows[:, 0, 0] // 100, chunk[:, 0].long())
        assert np.array_equal(sp_slice(indices.numpy(), r, sp), rows.numpy())


def test_sp_slice_rejects_ranks_without_activations():
    assert len(torch.chunk(torch.zeros(5), 4)) == 3  # torch.chunk: 3 chunks of 2, 2, 1
    with pytest.raises(ReplayError, match="no chunk for SP rank 3"):
        sp_slice(np.zeros((5, 1, 2)), 3, 4)
    with pytest.raises(ReplayError, match="rank"):
        sp_slice(np.zeros((5, 1, 2)), 2, 2)
    b = np.arange(2 * 6).reshape(2, 6)
    np.testing.assert_array_equal(sp_slice(b, 1, 2, dim=1), [[3, 4, 5], [9, 10, 11]])


# ----------------------------------------------------------------- -1 rows


def test_fill_own_choice_and_replayed_rows_by_hand():
    replay = np.array([[[3, 1], [-1, -1]], [[-1, -1], [0, 2]]])
    own = np.array([[[1, 2], [4, 5]], [[6, 7], [2, 0]]])
    assert replayed_rows(replay).tolist() == [[True, False], [False, True]]
    assert fill_own_choice(replay, own).tolist() == [[[3, 1], [4, 5]], [[6, 7], [0, 2]]]
    t = fill_own_choice(torch.from_numpy(replay), torch.from_numpy(own))
    assert t.tolist() == [[[3, 1], [4, 5]], [[6, 7], [0, 2]]]
    partial = np.array([[[3, -1]]])
    with pytest.raises(ReplayError, match="mix"):
        fill_own_choice(partial, np.array([[[0, 1]]]))
    assert fill_own_choice(partial, np.array([[[0, 1]]]), allow_partial_rows=True).tolist() == [[[3, -1]]]


@pytest.fixture(scope="module")
def model():
    m = Qwen3MoeForCausalLM(default_config(V))
    m.init_weights(7)
    with torch.no_grad():  # sharper routers: more distinct choices (as test_model_replay.py)
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(5.0)
    return m


def _ids(seed, b=2, s=12):
    return (torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed)),
            torch.arange(s).expand(b, s))


def _loss_and_grads(model, ids, pos, **replay):
    model.zero_grad(set_to_none=True)
    out = model(ids, pos, capture=True, **replay)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
    loss = -logp.mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, loss.detach(), grads


def test_all_minus_one_rows_use_own_choice_with_finite_grads(model):
    ids, pos = _ids(0)
    cfg = model.config
    base, base_loss, base_grads = _loss_and_grads(model, ids, pos)
    experts = torch.full(base.routed_experts.shape, -1, dtype=torch.int32)
    keys = torch.full(base.indexer_topk.shape, -1, dtype=torch.int32)
    out, loss, grads = _loss_and_grads(model, ids, pos, routed_experts=experts, indexer_topk=keys)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert torch.equal(out.logits, base.logits) and torch.equal(loss, base_loss)
    assert grads.keys() == base_grads.keys()
    assert all(torch.equal(grads[n], base_grads[n]) for n in grads)
    # Mixed: rows of token 5.. replay other experts, earlier rows are -1.
    other = (base.routed_experts + 1) % cfg.num_experts
    mixed = torch.where(torch.arange(ids.shape[1])[None, :, None, None] >= 5, other, experts)
    out, loss, grads = _loss_and_grads(model, ids, pos, routed_experts=mixed, indexer_topk=keys)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    # Filling the -1 rows with this forward's own choices replays the same forward exactly.
    filled = fill_own_choice(mixed, out.own_routed_experts)
    again = model(ids, pos, routed_experts=filled, indexer_topk=keys, capture=True)
    assert torch.equal(again.logits, out.logits)


# ----------------------------------------------------------------- check_replay / flip_rate


def test_check_replay_by_hand():
    # 3 tokens x 2 layers, K = 2. Token 1 layer 1 shares one of two experts; token 2 layer 0 is
    # not replayed (-1) and its other row is masked out of the loss.
    used = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[-1, -1], [0, 2]]])
    own = np.array([[[1, 0], [3, 2]], [[5, 4], [7, 1]], [[3, 4], [5, 6]]])
    mask = np.array([True, True, False])
    rep = check_replay(used, own, mask, 0.5, 0.5, layer_ids=[1, 3])
    assert rep.n_tokens == 2 and rep.n_rows == 4
    np.testing.assert_array_equal(rep.overlap[:2], [[1.0, 1.0], [1.0, 0.5]])
    assert np.isnan(rep.overlap[2]).all()
    np.testing.assert_array_equal(rep.token_min_overlap[:2], [1.0, 0.5])
    assert rep.min_overlap == 0.5 and rep.mismatched_tokens == 1 and rep.mismatch_fraction == 0.5
    assert [(m.token, m.layer, m.used, m.own) for m in rep.mismatches] == [(1, 3, (6, 7), (1, 7))]
    with pytest.raises(ReplayMismatch, match=r"token 1 layer 3: used \[6, 7\] own \[1, 7\]") as err:
        check_replay(used, own, mask, 0.75, 1.0, layer_ids=[1, 3])
    assert err.value.check.min_overlap == 0.5
    with pytest.raises(ReplayMismatch, match="1/2 tokens"):
        check_replay(used, own, mask, 0.0, 0.25)
    # Unmasked, token 2's replayed row (layer 3) shares nothing with its own choice.
    rep = check_replay(torch.from_numpy(used), torch.from_numpy(own), None, 0.0, 1.0)
    assert rep.n_tokens == 3 and rep.token_min_overlap[2] == 0.0 and rep.mismatch_fraction == 2 / 3


def test_check_replay_indexer_rows_with_empty_slots():
    # Key sets of different sizes: overlap = |U ∩ O| / max(|U|, |O|).
    used = np.array([[[0, -1, -1]], [[0, 1, -1]], [[2, 1, 0]]])
    own = np.array([[[0, -1, -1]], [[0, 1, 2]], [[0, 1, 2]]])
    rep = check_replay(used, own, None, 0.0, 1.0, kind="indexer")
    np.testing.assert_allclose(rep.overlap[:, 0], [1.0, 2 / 3, 1.0])
    assert rep.mismatches[0].used == (0, 1) and rep.mismatches[0].own == (0, 1, 2)
    empty = check_replay(np.full((2, 1, 2), -1), own[:2, :, :2], None, 1.0, 0.0)
    assert empty.n_tokens == 0 and math.isnan(empty.min_overlap)


def test_check_replay_rejects_bad_input():
    a = np.zeros((2, 1, 2), np.int64)
    with pytest.raises(ReplayError, match="one shape"):
        check_replay(a, np.zeros((2, 2, 2), np.int64), None, 0.5, 0.5)
    with pytest.raises(ReplayError, match="min_overlap_ratio"):
        check_replay(a, a, None, 1.5, 0.5)
    with pytest.raises(ReplayError, match="loss_rows_mask"):
        check_replay(a, a, np.ones(3, bool), 0.5, 0.5)
    with pytest.raises(ReplayError, match="< -1"):
        check_replay(a - 2, a, None, 0.5, 0.5)


def test_flip_rate_by_hand():
    used = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    own = np.array([[[1, 0], [2, 4]], [[5, 4], [6, 7]]])  # only (0, 1) differs as a set
    assert flip_rate(used, own, np.ones((2, 2), bool)) == 0.25
    assert flip_rate(used, own, np.array([False, True])) == 0.0
    assert flip_rate(used, own, np.array([[True, True], [False, False]])) == 0.5
    assert math.isnan(flip_rate(used, own, np.zeros(2, bool)))
    with pytest.raises(ReplayError, match="valid_rows"):
        flip_rate(used, own, np.ones(3, bool))


def test_flips_of_a_real_replay_are_counted(model):
    """Replay captured experts except chosen rows of the LAST MoE layer. Earlier layers replay
    what they chose, so every router input is unchanged and the own choice stays the captured
    one (the last layer's router runs before its experts): the flips are exactly those rows."""
    ids, pos = _ids(1, b=1, s=12)
    cfg = model.config
    with torch.no_grad():
        cap = model(ids, pos, capture=True)
    replay = cap.routed_experts.clone()
    last = len(cfg.moe_layers) - 1
    flipped = [2, 5, 9]
    for t in flipped:  # a disjoint expert set
        chosen = set(replay[0, t, last].tolist())
        replay[0, t, last] = torch.tensor([e for e in range(cfg.num_experts) if e not in chosen][:2])
    replay[0, 7, last] = replay[0, 7, last].flip(0)  # same set, other order: not a flip
    with torch.no_grad():
        out = model(ids, pos, routed_experts=replay, capture=True)
    used, own = out.routed_experts[0], out.own_routed_experts[0]
    assert torch.equal(used, replay[0]) and torch.equal(own, cap.routed_experts[0])
    t_rows, n_layers = used.shape[:2]
    assert flip_rate(used, own, replayed_rows(used)) == len(flipped) / (t_rows * n_layers)
    rep = check_replay(used, own, None, 0.0, 1.0, layer_ids=cfg.moe_layers)
    assert rep.mismatch_fraction == len(flipped) / t_rows and rep.min_overlap == 0.0
    assert [(m.token, m.layer) for m in rep.mismatches] == [(t, cfg.moe_layers[-1]) for t in flipped]
    with pytest.raises(ReplayMismatch, match=f"token 2 layer {cfg.moe_layers[-1]}"):
        check_replay(used, own, None, 0.9, 0.1, layer_ids=cfg.moe_layers)
    # The captured trace replayed as is: no flip, and the check passes at the strictest bounds.
    with torch.no_grad():
        same = model(ids, pos, routed_experts=cap.routed_experts, capture=True)
    assert flip_rate(same.routed_experts[0], same.own_routed_experts[0], np.ones(t_rows, bool)) == 0.0
    assert check_replay(same.routed_experts[0], same.own_routed_experts[0], None, 1.0, 0.0).min_overlap == 1.0
