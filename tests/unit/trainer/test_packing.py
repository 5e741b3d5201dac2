"""PackedLayout: cu_seqlens, per-segment shift (tests/cases/packed_shift.json), padding, pack /
unpack, against hand-written values (CP shards: tests/unit/trainer/test_context_parallel.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from replayrl.trainer.batching.packing import PackedLayout
from replayrl.trainer.errors import PackedFieldError, PackingError
from tests.paths import CASES

CASES = json.loads((CASES / "packed_shift.json").read_text())


# ----------------------------------------------------------------- shared acceptance cases


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_packed_shift_cases(case):
    cu = case["cu_seqlens"]
    layout = PackedLayout.from_lengths([b - a for a, b in zip(cu[:-1], cu[1:])])
    assert layout.cu_seqlens.tolist() == cu
    assert layout.cu_seqlens_padded.tolist() == cu
    expected = case["expected_next_token"]
    tokens = np.array(case["tokens"], dtype=np.int32)
    targets = layout.next_token_targets(tokens)
    assert targets.dtype == np.int32
    assert targets.tolist() == [-100 if e is None else e for e in expected]
    assert layout.target_mask.tolist() == [e is not None for e in expected]
    # torch tensors, another ignore value, and per-sample packing of the tokens give the same.
    segs = [tokens[a:b] for a, b in zip(cu[:-1], cu[1:])]
    packed = layout.pack([torch.from_numpy(s).long() for s in segs], 0, field="tokens")
    assert layout.next_token_targets(packed, ignore_index=-1).tolist() == \
        [-1 if e is None else e for e in expected]


def test_singleton_case_by_the_rule():
    case = next(c for c in CASES if c["name"] == "three_segments_with_singleton")
    layout = PackedLayout.from_lengths([3, 1, 3])
    assert layout.cu_seqlens.tolist() == case["cu_seqlens"]
    # segments [7, 8, 9] | [4] | [5, 6, 3]: same-segment successor, none at each segment's end
    assert layout.next_token_targets(np.array(case["tokens"])).tolist() == \
        [8, 9, -100, -100, 6, 3, -100]


# ----------------------------------------------------------------- layout by hand


def test_padding_positions_and_targets_by_hand():
    layout = PackedLayout.from_lengths([3, 5, 1], pad_to_multiple_of=4, sample_ids=["a", "b", "c"])
    assert layout.padded_lengths == (4, 8, 4)
    assert layout.total_length == 16
    assert layout.cu_seqlens.tolist() == [0, 3, 8, 9]
    assert layout.cu_seqlens_padded.tolist() == [0, 4, 12, 16]
    assert layout.cu_seqlens.dtype == np.int32
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert layout.segment_ids.tolist() == [0] * 4 + [1] * 8 + [2] * 4
    assert layout.real_mask.tolist() == [1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0]
    tokens = layout.pack([[1, 2, 3], [4, 5, 6, 7, 8], [9]], 0, field="tokens")
    assert tokens.tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 9, 0, 0, 0]
    n = -100
    assert layout.next_token_targets(tokens).tolist() == \
        [2, 3, n, n, 5, 6, 7, 8, n, n, n, n, n, n, n, n]
    with pytest.raises(AttributeError):
        layout.lengths = (1,)
    with pytest.raises(ValueError):
        layout.position_ids[0] = 5


def test_layout_is_a_value():
    a = PackedLayout.from_lengths([3, 2], pad_to_multiple_of=2)
    assert a == PackedLayout((3, 2), 2) and hash(a) == hash(PackedLayout((3, 2), 2))
    assert a != PackedLayout((3, 2), 1)
    assert PackedLayout.from_lengths([3, 2], cp_size=2).pad_to_multiple_of == 4
    assert PackedLayout.from_lengths([3], pad_to_multiple_of=6, cp_size=2).pad_to_multiple_of == 12


def test_shift_of_a_token_aligned_loss_mask():
    layout = PackedLayout.from_lengths([4, 3], pad_to_multiple_of=2)  # padded 4, 4
    mask = layout.pack([np.array([0, 0, 1, 1], np.uint8), np.array([0, 1, 1], np.uint8)], 0)
    assert layout.shift_to_next(mask, 0).tolist() == [0, 1, 1, 0, 1, 1, 0, 0]


def test_trace_rows_and_response_rows_land_where_the_contract_says():
    layout = PackedLayout.from_lengths([4, 3], pad_to_multiple_of=4)  # padded 4, 4
    # Trace rows cover positions 0 .. T-2; the last position and padding get -1.
    traces = [np.array([[10], [11], [12]]), np.array([[20], [21]])]
    packed = layout.pack(traces, -1, field="routed_experts", offsets=[0, 0])
    assert packed[:, 0].tolist() == [10, 11, 12, -1, 20, 21, -1, -1]
    # Response row j of a sample with prompt length P sits at the position P - 1 + j.
    resp = [np.array([0.5, 0.25]), np.array([0.75])]  # P = 2 and P = 2
    packed = layout.pack(resp, 0.0, field="rollout_logprobs", offsets=[1, 1])
    assert packed.tolist() == [0.0, 0.5, 0.25, 0.0, 0.0, 0.75, 0.0, 0.0]
    got = layout.unpack(packed, offsets=[1, 1], rows=[2, 1])
    assert [g.tolist() for g in got] == [[0.5, 0.25], [0.75]]


def test_key_slots_move_with_the_segment():
    layout = PackedLayout.from_lengths([3, 4], pad_to_multiple_of=4)  # starts 0 and 4
    keys = [np.array([[0, -1], [0, 1]], np.int32), np.array([[0, -1], [1, 0], [2, -1]], np.int32)]
    packed = layout.pack_key_slots(keys, offsets=[0, 0])
    assert packed.tolist() == [[0, -1], [0, 1], [-1, -1], [-1, -1],
                               [4, -1], [5, 4], [6, -1], [-1, -1]]
    back = layout.unpack_key_slots(packed, rows=[2, 3])
    for b, k in zip(back, keys):
        assert b.dtype == k.dtype
        np.testing.assert_array_equal(b, k)
    tpacked = layout.pack_key_slots([torch.from_numpy(k) for k in keys], offsets=[0, 0])
    assert tpacked.dtype == torch.int32 and tpacked.tolist() == packed.tolist()
    cross = packed.copy()
    cross[5, 0] = 1  # a key of sample 0 read by sample 1
    with pytest.raises(PackedFieldError, match="#1"):
        layout.unpack_key_slots(cross)
    with pytest.raises(PackedFieldError, match="indexer_topk"):
        layout.pack_key_slots([keys[0], np.array([[4]], np.int32).repeat(2, 1)], offsets=[0, 0])


# ----------------------------------------------------------------- errors


def test_errors_name_the_sample_and_the_field():
    layout = PackedLayout.from_lengths([3, 2], sample_ids=["s0", "s1"])
    with pytest.raises(PackedFieldError, match=r"sample s1: field 'loss_mask'.*3 rows.*2 tokens") as err:
        layout.pack([np.zeros(3), np.zeros(3)], 0.0, field="loss_mask")
    # a PackingError (one project base, docs/design/errors.md#errors) naming the sample and the
    # field as a SampleError does
    assert isinstance(err.value, PackingError) and isinstance(err.value, ValueError)
    assert (err.value.sample_id, err.value.field) == ("s1", "loss_mask")
    with pytest.raises(PackedFieldError, match="s1.*routed_experts.*shape"):
        layout.pack([np.zeros((2, 3, 2), np.int32), np.zeros((1, 2, 2), np.int32)], -1,
                    field="routed_experts", offsets=[0, 0])
    with pytest.raises(PackedFieldError, match="s1.*dtype"):
        layout.pack([np.zeros(3, np.int32), np.zeros(2, np.int64)], 0)
    with pytest.raises(PackedFieldError, match="s0.*offset 1"):
        layout.pack([np.zeros(3), np.zeros(1)], 0.0, offsets=[1, 0])
    with pytest.raises(PackingError, match="uint8"):
        layout.pack([np.zeros(3, np.uint8), np.zeros(2, np.uint8)], -1)
    with pytest.raises(PackingError, match="2 arrays for"):
        PackedLayout.from_lengths([3, 2, 1]).pack([np.zeros(3), np.zeros(2)], 0.0)
    with pytest.raises(PackedFieldError, match="#1.*length"):
        PackedLayout.from_lengths([3, 0])
    with pytest.raises(PackingError, match="empty"):
        PackedLayout.from_lengths([])
    with pytest.raises(PackingError, match="pad_to_multiple_of"):
        PackedLayout.from_lengths([3], pad_to_multiple_of=0)


def test_next_token_targets_need_integer_tokens():
    with pytest.raises(PackingError, match="1-D integer"):
        PackedLayout.from_lengths([3, 2], cp_size=2).next_token_targets(np.zeros(8, np.float32))
