"""TokenMetadataTrace (rollout/traces/trace.py): schema fixing, -1 padding rows, finalize exactly once."""

from __future__ import annotations

import json

import numpy as np
import pytest

from replayrl.rollout.errors import SampleError, TraceFinalizedError, TraceRowsError, TraceSchemaError
from replayrl.rollout.traces.trace import TokenMetadataTrace
from tests.paths import CASES

CASES = {c["name"]: c for c in json.loads((CASES / "trace_alignment.json").read_text())}
SID = 17


def expect(cls, field, fn, *args, **kwargs) -> SampleError:
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    err = info.value
    assert isinstance(err, SampleError) and err.sample_id == SID
    assert field in err.field
    assert f"sample {SID}" in str(err)
    return err


def test_multi_turn_observation_rows():
    case = CASES["multi_turn_observation_rows"]
    mask = case["loss_mask"]  # [1,1,1, 0,0,0,0, 1,1]
    turn0 = [[5, 5, 6, 7], [6, 6, 5, -1], [2, 2, 9, 8]]  # 3 generated tokens, W = 3
    turn1 = [[8, 8, 3, 1], [2, 3, 2, -1]]                # 2 generated tokens
    trace = TokenMetadataTrace(SID)
    trace.append({"sample_support": turn0})
    trace.append_padding(mask.count(0))  # 4 observation tokens
    trace.append({"sample_support": turn1})
    assert trace.rows == case["expected_support_rows"] == 9
    support = trace.finalize(len(mask))["sample_support"]
    assert support.shape == (9, 4) and support.dtype == np.int32
    expected = turn0 + [[-1, -1, -1, -1]] * 4 + turn1
    assert support.tolist() == expected
    observation = np.array(mask) == 0
    assert case["expected_observation_rows_all_minus_one"]
    assert (support[observation] == -1).all()
    assert (support[~observation, 0] >= 0).all()


def test_padding_before_first_chunk_takes_its_shape():
    trace = TokenMetadataTrace(SID)
    trace.append_padding(2)
    trace.append({"routed_experts": np.arange(12).reshape(3, 2, 2)})
    out = trace.finalize(5)["routed_experts"]
    assert out.shape == (5, 2, 2)
    assert out[:2].tolist() == [[[-1, -1], [-1, -1]]] * 2
    assert out[2:].reshape(-1).tolist() == list(range(12))


def test_several_fields_and_int64_input_become_read_only_int32_copies():
    routed = np.array([[[0, 3]], [[1, 2]]], dtype=np.int64)
    keys = np.array([[[0, -1]], [[0, 1]]], dtype=np.int64)
    trace = TokenMetadataTrace(SID)
    trace.append({"routed_experts": routed, "indexer_topk": keys})
    trace.append_padding(1)
    out = trace.finalize(3)
    routed[0, 0, 0] = 7  # the caller's buffer: must not leak into the trace
    assert set(out) == {"routed_experts", "indexer_topk"}
    assert out["routed_experts"].tolist() == [[[0, 3]], [[1, 2]], [[-1, -1]]]
    assert out["indexer_topk"].tolist() == [[[0, -1]], [[0, 1]], [[-1, -1]]]
    for arr in out.values():
        assert arr.dtype == np.int32 and not arr.flags.writeable
    with pytest.raises(TypeError):
        out["routed_experts"] = None  # the mapping itself is read-only


def test_empty_schema_counts_rows():
    trace = TokenMetadataTrace(SID)
    trace.append({}, rows=3)
    trace.append_padding(2)
    trace.append({}, rows=1)
    assert trace.schema == {}
    assert dict(trace.finalize(6)) == {}


def test_empty_chunk_needs_rows():
    expect(TraceRowsError, "<rows>", TokenMetadataTrace(SID).append, {})


def test_later_chunk_missing_a_field_names_it():
    trace = TokenMetadataTrace(SID)
    trace.append({"routed_experts": np.zeros((2, 1, 2), int), "indexer_topk": np.zeros((2, 1, 3), int)})
    err = expect(TraceSchemaError, "indexer_topk", trace.append, {"routed_experts": np.zeros((1, 1, 2), int)})
    assert "missing" in str(err)


def test_later_chunk_with_an_extra_field_names_it():
    trace = TokenMetadataTrace(SID)
    trace.append({"routed_experts": np.zeros((2, 1, 2), int)})
    expect(TraceSchemaError, "indexer_topk", trace.append,
           {"routed_experts": np.zeros((1, 1, 2), int), "indexer_topk": np.zeros((1, 1, 3), int)})


def test_later_chunk_with_another_trailing_shape_names_it():
    trace = TokenMetadataTrace(SID)
    trace.append({"sample_support": np.zeros((2, 4), int)})
    err = expect(TraceSchemaError, "sample_support", trace.append, {"sample_support": np.zeros((1, 5), int)})
    assert "(5,)" in str(err) and "(4,)" in str(err)


@pytest.mark.parametrize("value, problem", [
    (np.zeros((2, 3), np.float32), "integer"),
    (np.array([[0, -2]]), "[-1,"),
    (np.array([[0, 2**31]]), "[-1,"),
    (np.int32(3), "row axis"),
])
def test_bad_values_are_rejected_not_cast(value, problem):
    err = expect(TraceSchemaError, "sample_support", TokenMetadataTrace(SID).append, {"sample_support": value})
    assert problem in str(err)


def test_fields_of_one_chunk_must_agree_on_rows():
    trace = TokenMetadataTrace(SID)
    expect(TraceRowsError, "indexer_topk", trace.append,
           {"routed_experts": np.zeros((3, 1, 2), int), "indexer_topk": np.zeros((2, 1, 3), int)})
    expect(TraceRowsError, "routed_experts", trace.append, {"routed_experts": np.zeros((3, 1, 2), int)}, rows=2)


def test_finalize_with_wrong_row_count_names_fields_and_counts_and_stays_open():
    trace = TokenMetadataTrace(SID)
    trace.append({"routed_experts": np.zeros((4, 1, 2), int), "indexer_topk": np.zeros((4, 1, 3), int)})
    err = expect(TraceRowsError, "routed_experts", trace.finalize, 5)
    assert "indexer_topk" in err.field
    assert "4 rows" in str(err) and "expected 5" in str(err)
    assert not trace.finalized
    assert trace.finalize(4)["routed_experts"].shape == (4, 1, 2)


def test_finalize_exactly_once():
    trace = TokenMetadataTrace(SID)
    trace.append({"sample_support": np.zeros((1, 2), int)})
    trace.finalize(1)
    assert trace.finalized
    expect(TraceFinalizedError, "<trace>", trace.finalize, 1)
    expect(TraceFinalizedError, "<trace>", trace.append, {"sample_support": np.zeros((1, 2), int)})
    expect(TraceFinalizedError, "<trace>", trace.append_padding, 1)


@pytest.mark.parametrize("n", [-1, 1.0, True])
def test_padding_count_must_be_a_non_negative_int(n):
    expect(TraceRowsError, "<padding>", TokenMetadataTrace(SID).append_padding, n)
