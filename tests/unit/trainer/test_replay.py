"""Live replay checks: -1 rows, replay check and flip rate, on hand-built arrays and on the
embedded Qwen3-MoE model (the PP registry and SP slicing: tests/unit/trainer/test_replay_registry.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from replayrl.rollout.model import Qwen3MoeForCausalLM, default_config
from replayrl.trainer.errors import ReplayError, ReplayMismatch
from replayrl.trainer.parallel.replay_registry import fill_own_choice
from replayrl.trainer.replay.checks import check_replay, flip_rate, replayed_rows

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


# ----------------------------------------------------------------- -1 rows


def test_replayed_rows_by_hand():
    replay = np.array([[[3, 1], [-1, -1]], [[-1, -1], [0, 2]]])
    assert replayed_rows(replay).tolist() == [[True, False], [False, True]]
    assert replayed_rows(torch.from_numpy(replay)).tolist() == [[True, False], [False, True]]


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


@pytest.mark.parametrize("repeats", [False, True])
def test_flip_rate_matches_python_sets(repeats):
    # the sorted-row fast path (no repeated entry) and the general path (repeats) against sets
    rng = np.random.default_rng(3)
    T, L, K = 200, 2, 4
    if repeats:
        used = rng.integers(-1, 4, size=(T, L, K))
        own = rng.integers(-1, 4, size=(T, L, K))
    else:
        used = np.stack([[rng.permutation(np.arange(-1, 7))[:K] for _ in range(L)] for _ in range(T)])
        own = used.copy()
        own[::3] = np.stack([[rng.permutation(np.arange(-1, 7))[:K] for _ in range(L)]
                             for _ in range(len(own[::3]))])
        own[1::5] = own[1::5][..., ::-1]  # same set, other order: no flip
        # several -1 per row, as an indexer row over fewer keys than K has them
        used[7, 0] = own[7, 0] = [-1, -1, 3, 5]
        used[8, 1], own[8, 1] = [-1, -1, 3, 5], [-1, 3, -1, 5]
    valid = rng.random((T, L)) < 0.8
    sets = lambda row: {int(x) for x in row if x >= 0}
    expected = np.mean([sets(used[t, layer]) != sets(own[t, layer])
                        for t in range(T) for layer in range(L) if valid[t, layer]])
    assert flip_rate(used, own, valid) == pytest.approx(expected, abs=1e-12)
    assert flip_rate(torch.from_numpy(used), torch.from_numpy(own), torch.from_numpy(valid)) == \
        pytest.approx(expected, abs=1e-12)
