"""Replay on a split model: registry by global layer id (PP stages), SP slicing, filling -1
rows, on hand-built arrays and on the embedded Qwen3-MoE model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from replayrl.rollout.model import Qwen3MoeForCausalLM, default_config
from replayrl.trainer.errors import ReplayError
from replayrl.trainer.parallel.replay_registry import ReplayRegistry, fill_own_choice, sp_slice

V = 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny model forwards: with 2 OpenMP threads on a shared 2-vCPU machine every small op
    waits at a barrier whenever a neighbour holds a core; restored afterwards so other modules
    keep their setting."""
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


def test_fill_own_choice_by_hand():
    replay = np.array([[[3, 1], [-1, -1]], [[-1, -1], [0, 2]]])
    own = np.array([[[1, 2], [4, 5]], [[6, 7], [2, 0]]])
    assert fill_own_choice(replay, own).tolist() == [[[3, 1], [4, 5]], [[6, 7], [0, 2]]]
    t = fill_own_choice(torch.from_numpy(replay), torch.from_numpy(own))
    assert t.tolist() == [[[3, 1], [4, 5]], [[6, 7], [0, 2]]]
    partial = np.array([[[3, -1]]])
    with pytest.raises(ReplayError, match="mix"):
        fill_own_choice(partial, np.array([[[0, 1]]]))
    assert fill_own_choice(partial, np.array([[[0, 1]]]), allow_partial_rows=True).tolist() == [[[3, -1]]]
