"""Context-parallel shards of a packed layout: front/back chunk indices by hand and against a
naive loop, round trips through the shards, autograd, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.trainer.batching.packing import PackedLayout
from replayrl.trainer.errors import PackedFieldError, PackingError
from replayrl.trainer.parallel.context_parallel import cp_shard, cp_shard_indices, cp_unshard


def test_cp2_shard_indices_by_hand():
    layout = PackedLayout.from_lengths([3, 6], cp_size=2)  # padded 4 and 8
    assert layout.padded_lengths == (4, 8)
    # seg 0: chunks of 1 -> rank 0 chunks 0,3; seg 1 (start 4): chunks of 2 -> rank 0 chunks 0,3
    assert cp_shard_indices(layout, 0, 2).tolist() == [0, 3, 4, 5, 10, 11]
    assert cp_shard_indices(layout, 1, 2).tolist() == [1, 2, 6, 7, 8, 9]
    assert cp_shard_indices(layout, 0, 1).tolist() == list(range(12))
    pos = cp_shard(layout, layout.position_ids, 1, 2)
    assert pos.tolist() == [1, 2, 2, 3, 4, 5]


def _naive_cp_indices(padded_lengths, rank, cp):
    out, start = [], 0
    for n in padded_lengths:
        chunk = n // (2 * cp)
        chunks = [list(range(start + c * chunk, start + (c + 1) * chunk)) for c in range(2 * cp)]
        out += chunks[rank] + chunks[2 * cp - 1 - rank]
        start += n
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_shard_indices_match_naive_chunking(cp):
    layout = PackedLayout.from_lengths([7, 1, 12, 5], pad_to_multiple_of=3, cp_size=cp)
    seen = []
    for r in range(cp):
        idx = cp_shard_indices(layout, r, cp).tolist()
        assert idx == _naive_cp_indices(layout.padded_lengths, r, cp)
        seen += idx
    assert sorted(seen) == list(range(layout.total_length))


LENGTHS = [5, 1, 8, 3]  # odd lengths, one singleton


def _samples(seed=0):
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, 1000, n).astype(np.int32) for n in LENGTHS]
    floats = [rng.standard_normal(n).astype(np.float32) for n in LENGTHS]
    traces = [rng.integers(0, 8, (n - 1, 3, 2)).astype(np.int32) for n in LENGTHS]  # T-1 rows
    return tokens, floats, traces


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("as_torch", [False, True])
def test_round_trip_through_cp_shards(cp, as_torch):
    layout = PackedLayout.from_lengths(LENGTHS, pad_to_multiple_of=2, cp_size=cp)
    tokens, floats, traces = _samples()
    conv = (lambda xs: [torch.from_numpy(x) for x in xs]) if as_torch else (lambda xs: xs)
    for arrays, pad, kw in ((tokens, 0, {}), (floats, float("nan"), {}),
                            (traces, -1, {"offsets": [0] * 4})):
        packed = layout.pack(conv(arrays), pad, **kw)
        assert packed.shape[0] == layout.total_length
        shards = [cp_shard(layout, packed, r, cp) for r in range(cp)]
        assert all(s.shape[0] == layout.total_length // cp for s in shards)
        back = cp_unshard(layout, shards)
        got = layout.unpack(back, rows=[a.shape[0] for a in arrays], **kw)
        for g, a in zip(got, arrays):
            g = g.numpy() if as_torch else g
            assert g.dtype == a.dtype and g.shape == a.shape
            np.testing.assert_array_equal(g, a)


def test_torch_pack_shard_unpack_are_differentiable():
    layout = PackedLayout.from_lengths([3, 2], cp_size=2)
    xs = [torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)]
    packed = layout.pack(xs, 0.0)
    back = cp_unshard(layout, [cp_shard(layout, packed, r, 2) for r in range(2)])
    weights = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0])]
    sum(w @ y for w, y in zip(weights, layout.unpack(back))).backward()
    for x, w in zip(xs, weights):
        assert torch.equal(x.grad, w)


def test_cp_errors():
    layout = PackedLayout.from_lengths([3, 2])
    with pytest.raises(PackedFieldError, match=r"#0.*multiple of 2 \* cp_size = 4.*cp_size=2"):
        cp_shard_indices(layout, 0, 2)
    cp_layout = PackedLayout.from_lengths([3, 2], cp_size=2)
    with pytest.raises(PackingError, match="rank"):
        cp_shard_indices(cp_layout, 2, 2)
    with pytest.raises(PackingError, match="rows"):
        cp_shard(cp_layout, np.zeros(7), 0, 2)
    with pytest.raises(PackingError, match="shard of CP rank 1"):
        cp_unshard(cp_layout, [np.zeros(4), np.zeros(3)])
