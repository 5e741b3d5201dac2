"""collate (trainer/batching/batch.py) and the proximal-logprob cache (trainer/ranks/proximal_cache.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from replayrl.rollout.errors import SampleError
from replayrl.rollout.sample import Sample
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.errors import ProximalCacheError
from replayrl.trainer.ranks.proximal_cache import ProximalLogprobCache
from tests.devices import DEVICES

L_MOE, K_ROUTER, L_IDX, K_IDX = 2, 2, 1, 3


def sample(sid, prompt, response, *, mask=None, logprobs=None, support=True, routing=True,
           indexer=True, width=2):
    """A trajectory whose trace values encode (sample id, row) so misplaced rows are visible."""
    P, R = len(prompt), len(response)
    if mask is None:
        mask = [1] * R
    if logprobs is None:
        logprobs = [-(sid + 0.25 * j) for j in range(R)]
    sup = None
    if support:
        sup = [[t] + [100 * sid + j] * width for j, t in enumerate(response)]
    routed = None
    if routing:
        routed = [[[1000 * sid + r] * K_ROUTER] * L_MOE for r in range(P + R - 1)]
    idx = None
    if indexer:
        idx = [[[r] * K_IDX] * L_IDX for r in range(P + R - 1)]
    return Sample(sample_id=sid, group_id=0, rollout_id=0, policy_version=0, prompt_ids=prompt,
                  response_ids=response, loss_mask=np.array(mask, dtype=np.uint8),
                  rollout_logprobs=logprobs, sample_support=sup, routed_experts=routed,
                  indexer_topk=idx)


def three_samples():
    # lengths P+R: 5, 3, 4 -> T = 5
    a = sample(1, [1, 13, 17], [5, 2])
    b = sample(2, [1, 14], [7], logprobs=[-2.0])
    c = sample(3, [1], [6, 8, 2], mask=[1, 0, 1], logprobs=[-0.5, math.nan, -1.0])
    return [a, b, c]


def collate_all(samples):
    return collate(samples, routing=True, indexer=True, support=True)


# ---------------------------------------------------------------- collate


def test_tokens_are_right_padded_with_a_key_padding_mask():
    batch = collate_all(three_samples())
    assert batch.tokens.dtype == torch.int64
    assert batch.tokens.tolist() == [
        [1, 13, 17, 5, 2],
        [1, 14, 7, 0, 0],
        [1, 6, 8, 2, 0],
    ]
    assert batch.key_padding_mask.dtype == torch.bool
    assert batch.key_padding_mask.tolist() == [
        [True, True, True, True, True],
        [True, True, True, False, False],
        [True, True, True, True, False],
    ]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 3


def test_row_and_pos_of_each_response_token_by_hand():
    batch = collate_all(three_samples())
    # sample 0: P=3, R=2 -> pos 2, 3; sample 1: P=2, R=1 -> pos 1; sample 2: P=1, R=3 -> pos 0, 1, 2
    assert batch.row.tolist() == [0, 0, 1, 2, 2, 2]
    assert batch.pos.tolist() == [2, 3, 1, 0, 1, 2]
    assert batch.targets.tolist() == [5, 2, 7, 6, 8, 2]
    # the logits at (row, pos) predict the token one to the right
    assert batch.tokens[batch.row, batch.pos + 1].tolist() == batch.targets.tolist()
    assert batch.row.dtype == batch.pos.dtype == batch.targets.dtype == torch.int64


def test_per_token_arrays_concatenated_in_sample_order():
    batch = collate_all(three_samples())
    assert batch.loss_mask.dtype == torch.float32
    assert batch.loss_mask.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    lp = batch.rollout_logprobs
    assert lp.dtype == torch.float32
    assert lp[[0, 1, 2, 3, 5]].tolist() == [-1.0, -1.25, -2.0, -0.5, -1.0]
    assert math.isnan(lp[4].item())  # NaN allowed where the loss mask is 0


def test_support_rows_concatenated_in_order():
    batch = collate_all(three_samples())
    assert batch.support.dtype == torch.int64
    assert batch.support.tolist() == [
        [5, 100, 100], [2, 101, 101],
        [7, 200, 200],
        [6, 300, 300], [8, 301, 301], [2, 302, 302],
    ]


def test_trace_tensors_padded_with_minus_one_beyond_p_plus_r_minus_1_rows():
    batch = collate_all(three_samples())
    routed, idx = batch.routed_experts, batch.indexer_topk
    assert routed.shape == (3, 5, L_MOE, K_ROUTER) and routed.dtype == torch.int64
    assert idx.shape == (3, 5, L_IDX, K_IDX) and idx.dtype == torch.int64
    # P+R-1 rows per sample: 4, 2, 3; every later row is -1
    expected_routed = [
        [1000, 1000, 1000, 1000, -1],
        [2000, 2000, -1, -1, -1],
        [3000, 3000, 3000, -1, -1],
    ]
    expected_routed = [[v + (r if v >= 0 else 0) for r, v in enumerate(row)] for row in expected_routed]
    for b in range(3):
        for t in range(5):
            assert (routed[b, t] == expected_routed[b][t]).all(), (b, t)
    expected_idx = [
        [0, 1, 2, 3, -1],
        [0, 1, -1, -1, -1],
        [0, 1, 2, -1, -1],
    ]
    for b in range(3):
        for t in range(5):
            assert (idx[b, t] == expected_idx[b][t]).all(), (b, t)


def test_unselected_traces_are_left_out():
    batch = collate(three_samples(), routing=False, indexer=False, support=False)
    assert batch.routed_experts is None and batch.indexer_topk is None and batch.support is None
    assert batch.targets.tolist() == [5, 2, 7, 6, 8, 2]


def test_single_sample_has_no_padding():
    s = sample(5, [1, 13, 17], [5, 2])
    batch = collate_all([s])
    assert batch.key_padding_mask.all()
    assert batch.pos.tolist() == [2, 3]
    assert (batch.routed_experts[0, :4, 0, 0] == torch.tensor([5000, 5001, 5002, 5003])).all()
    assert (batch.routed_experts[0, 4] == -1).all()  # the last token is never forwarded


@pytest.mark.parametrize("field,flag", [("routed_experts", "routing"), ("indexer_topk", "indexer")])
def test_one_sample_lacking_a_trace_others_have_is_named(field, flag):
    a = sample(1, [1, 13, 17], [5, 2])
    b = sample(2, [1, 14], [7], **{"routing" if field == "routed_experts" else "indexer": False})
    kwargs = {"routing": False, "indexer": False, "support": False, flag: True}
    with pytest.raises(SampleError) as info:
        collate([a, b], **kwargs)
    assert info.value.sample_id == 2 and info.value.field == field
    assert "sample 2" in str(info.value)


def test_sample_lacking_support_with_support_replay_on_is_named():
    a = sample(1, [1, 13, 17], [5, 2])
    b = sample(2, [1, 14], [7], support=False)
    with pytest.raises(SampleError) as info:
        collate([a, b], routing=False, indexer=False, support=True)
    assert info.value.sample_id == 2 and info.value.field == "sample_support"


def test_trace_row_shape_mismatch_is_named():
    a = sample(1, [1, 13, 17], [5, 2])
    b = Sample(sample_id=2, group_id=0, rollout_id=0, policy_version=0, prompt_ids=[1, 14],
               response_ids=[7], loss_mask=np.ones(1, np.uint8), rollout_logprobs=[-1.0],
               routed_experts=np.zeros((2, L_MOE + 1, K_ROUTER), np.int32))
    with pytest.raises(SampleError) as info:
        collate([a, b], routing=True, indexer=False, support=False)
    assert info.value.sample_id == 2 and info.value.field == "routed_experts"


def test_support_width_mismatch_is_named():
    a = sample(1, [1, 13, 17], [5, 2], width=2)
    b = sample(2, [1, 14], [7], width=3)
    with pytest.raises(SampleError) as info:
        collate([a, b], routing=False, indexer=False, support=True)
    assert info.value.sample_id == 2 and info.value.field == "sample_support"


def test_empty_batch_raises():
    with pytest.raises(ValueError):
        collate([], routing=True, indexer=True, support=True)


# ---------------------------------------------------------------- ProximalLogprobCache


def test_the_cache_pins_host_memory_only_for_a_cuda_trainer():
    assert ProximalLogprobCache().pinned is False  # the CPU, by default
    assert ProximalLogprobCache(device=torch.device("cpu")).pinned is False
    assert ProximalLogprobCache(device=torch.device("cuda", 0)).pinned is True  # decided, not allocated


@pytest.mark.parametrize("device", DEVICES)
def test_entries_from_the_device_wait_on_the_host(device):
    cache = ProximalLogprobCache(device=torch.device(device))
    cache.put(1, torch.tensor([-0.5, -1.25], device=device))
    cache.put(2, torch.tensor([-3.0], device=device))
    assert cache.peek(2).tolist() == [-3.0]
    (got,) = cache.take([1])
    assert got.device.type == "cpu" and got.is_pinned() is (device == "cuda")
    assert got.tolist() == [-0.5, -1.25]


def test_put_take_returns_entries_in_requested_order_as_copies():
    cache = ProximalLogprobCache()
    src = {7: torch.tensor([-0.5, -1.0]), 3: torch.tensor([-2.0]), 9: torch.tensor([-0.25, -0.75, -3.0])}
    for sid, t in src.items():
        cache.put(sid, t)
    src[7][0] = 99.0  # the cache holds a copy
    out = cache.take([9, 7])
    assert [t.tolist() for t in out] == [[-0.25, -0.75, -3.0], [-0.5, -1.0]]
    assert all(t.dtype == torch.float32 for t in out)
    assert list(cache.entries) == [3]
    assert cache.take([3])[0].tolist() == [-2.0]
    assert cache.entries == {}


def test_put_converts_to_float32_and_detaches():
    cache = ProximalLogprobCache()
    x = torch.tensor([-0.5, -1.5], dtype=torch.float64, requires_grad=True)
    cache.put(1, x * 1.0)
    (got,) = cache.take([1])
    assert got.dtype == torch.float32 and not got.requires_grad
    assert got.tolist() == [-0.5, -1.5]


def test_byte_accounting_and_peak():
    cache = ProximalLogprobCache(max_bytes=100)
    cache.put(1, torch.zeros(5))      # 20 bytes
    cache.put(2, torch.zeros(10))     # 40 bytes -> 60
    assert (cache.nbytes, cache.peak_bytes) == (60, 60)
    cache.take([1])                   # -> 40
    assert (cache.nbytes, cache.peak_bytes) == (40, 60)
    cache.put(3, torch.zeros(15, dtype=torch.float64))  # stored as float32: 60 bytes -> 100 == cap
    assert (cache.nbytes, cache.peak_bytes) == (100, 100)
    cache.take([2, 3])
    assert (cache.nbytes, cache.peak_bytes) == (0, 100)


def test_byte_cap_error_names_the_sample_and_stores_nothing():
    cache = ProximalLogprobCache(max_bytes=40)
    cache.put(1, torch.zeros(6))  # 24 bytes
    with pytest.raises(ProximalCacheError, match="sample 2"):
        cache.put(2, torch.zeros(5))  # 24 + 20 = 44 > 40
    assert list(cache.entries) == [1] and cache.nbytes == 24 and cache.peak_bytes == 24
    cache.put(3, torch.zeros(4))  # exactly up to the cap is fine
    assert cache.nbytes == 40


def test_duplicate_put_is_an_error_and_keeps_the_first_entry():
    cache = ProximalLogprobCache()
    cache.put(4, torch.tensor([-1.0]))
    with pytest.raises(ProximalCacheError, match="sample 4"):
        cache.put(4, torch.tensor([-2.0, -3.0]))
    assert cache.nbytes == 4
    assert cache.take([4])[0].tolist() == [-1.0]


def test_take_with_missing_ids_names_them_and_removes_nothing():
    cache = ProximalLogprobCache()
    cache.put(1, torch.tensor([-1.0]))
    cache.put(2, torch.tensor([-2.0, -2.5]))
    with pytest.raises(ProximalCacheError) as info:
        cache.take([1, 5, 2, 6])
    assert "[5, 6]" in str(info.value)
    assert sorted(cache.entries) == [1, 2] and cache.nbytes == 12
    assert [t.tolist() for t in cache.take([2, 1])] == [[-2.0, -2.5], [-1.0]]


def test_clear_drops_everything_but_keeps_the_peak():
    cache = ProximalLogprobCache()
    cache.put(1, torch.zeros(3))
    cache.clear()
    assert cache.entries == {} and cache.nbytes == 0 and cache.peak_bytes == 12
    cache.put(1, torch.zeros(1))  # the id may be cached again after a clear
    assert cache.nbytes == 4


def test_take_with_a_repeated_id_is_a_cache_error_and_removes_nothing():
    cache = ProximalLogprobCache()
    cache.put(1, torch.tensor([-1.0]))
    with pytest.raises(ProximalCacheError):
        cache.take([1, 1])
    assert list(cache.entries) == [1] and cache.nbytes == 4
