"""Traces cross the column forms stored as the trace table says: expert ids back exactly,
indexer rows back as the same key sets (ascending, -1 after), what no codec holds exactly
travels as it is, and a malformed encoded column is an error naming it."""
from __future__ import annotations

import numpy as np
import pytest

from replayrl.rollout.engines.base import Generation, generations_from_columns, generations_to_columns
from replayrl.rollout.errors import EngineInputError, SampleError
from replayrl.rollout.sample import Sample, samples_from_columns, samples_to_columns
from replayrl.rollout.traces.trace_storage import row_positions
from replayrl.transport.codec import Codec

K = 3


def _keys(rows: int, rng: np.random.Generator) -> np.ndarray:
    """Causal indexer rows as an engine lists them: by score (here shuffled), -1 after."""
    out = np.full((rows, 2, K), -1, np.int32)
    for p in range(rows):
        for layer in range(2):
            c = min(K, p + 1)
            out[p, layer, :c] = rng.choice(p + 1, size=c, replace=False)
    return out


def _sample(sid: int, P: int, R: int, **kw) -> Sample:
    rng = np.random.default_rng(sid)
    rows = P + R - 1
    kw.setdefault("indexer_topk", _keys(rows, rng))
    routed = rng.integers(0, 256, (rows, 2, 4)).astype(np.int32)
    routed[0] = -1  # a row nobody captured
    return Sample(sample_id=sid, group_id=0, rollout_id=1, policy_version=0,
                  prompt_ids=rng.integers(0, 9, P), response_ids=rng.integers(0, 9, R),
                  loss_mask=np.ones(R, np.uint8), rollout_logprobs=-rng.random(R).astype(np.float32),
                  routed_experts=routed, **kw)


def _as_sets(a: np.ndarray) -> list:
    return [sorted(v for v in row if v >= 0) for row in a.reshape(-1, a.shape[-1]).tolist()]


def test_row_positions_count_within_each_item():
    assert row_positions([3, 0, 2]).tolist() == [0, 1, 2, 0, 1]


def test_samples_keep_their_experts_exactly_and_their_keys_as_sets():
    samples = [_sample(0, 4, 3), _sample(1, 6, 1), _sample(2, 2, 5)]
    cols = samples_to_columns(samples)
    assert cols["routed_experts"]["values"].dtype == np.uint8
    assert cols["indexer_topk"]["codec"] == "sets"
    back = samples_from_columns(Codec().decode(Codec().encode(cols)))
    for a, b in zip(samples, back):
        assert b.routed_experts.dtype == np.int32 and np.array_equal(a.routed_experts, b.routed_experts)
        assert b.indexer_topk.dtype == np.int32 and not b.indexer_topk.flags.writeable
        assert _as_sets(a.indexer_topk) == _as_sets(b.indexer_topk)
        canonical = [s + [-1] * (K - len(s)) for s in _as_sets(a.indexer_topk)]
        assert b.indexer_topk.reshape(-1, K).tolist() == canonical


def test_keys_no_set_codec_holds_travel_as_they_are():
    dup = _keys(5, np.random.default_rng(3))
    dup[4, 0] = [2, 2, -1]  # a repeated key: no set
    sample = _sample(0, 3, 3, indexer_topk=dup)
    cols = samples_to_columns([sample])
    assert isinstance(cols["indexer_topk"], np.ndarray)
    assert np.array_equal(samples_from_columns(cols)[0].indexer_topk, dup)


def test_generations_keep_their_experts_exactly_and_their_keys_as_sets():
    rng = np.random.default_rng(5)
    gens = [Generation(response_ids=np.arange(R, dtype=np.int32),
                       rollout_logprobs=np.zeros(R, np.float32),
                       routed_experts=rng.integers(0, 8, (P + R - 1, 1, 2)).astype(np.int32),
                       indexer_topk=_keys(P + R - 1, rng), finish_reason="stop")
            for P, R in ((3, 2), (5, 1))]
    back = generations_from_columns(Codec().decode(Codec().encode(generations_to_columns(gens))))
    for a, b in zip(gens, back):
        assert np.array_equal(a.routed_experts, b.routed_experts)
        assert _as_sets(a.indexer_topk) == _as_sets(b.indexer_topk)


def test_a_malformed_encoded_column_is_named():
    cols = samples_to_columns([_sample(0, 4, 3)])
    cols["indexer_topk"] = {**cols["indexer_topk"], "shape": [99, 2, K]}
    with pytest.raises(SampleError, match="'indexer_topk'.*99"):
        samples_from_columns(cols)
    cols = samples_to_columns([_sample(0, 4, 3)])
    cols["routed_experts"] = {**cols["routed_experts"], "codec": "sets"}
    with pytest.raises(SampleError, match="'routed_experts'.*storage 'ids'"):
        samples_from_columns(cols)
    gcols = generations_to_columns([Generation(
        response_ids=np.arange(2, dtype=np.int32), rollout_logprobs=np.zeros(2, np.float32),
        indexer_topk=_keys(4, np.random.default_rng(0)), finish_reason="stop")])
    gcols["indexer_topk"] = {**gcols["indexer_topk"], "kind": np.zeros(1, np.uint8)}
    with pytest.raises(EngineInputError, match="'indexer_topk'.*kind"):
        generations_from_columns(gcols)


def test_a_large_column_travels_in_chunks_of_rows(monkeypatch):
    from replayrl.rollout.traces import trace_storage

    monkeypatch.setattr(trace_storage, "CHUNK_SLOTS", 2 * 2 * K)  # two rows of [2, K] a chunk
    samples = [_sample(0, 4, 3), _sample(1, 3, 2)]  # 6 + 4 rows: chunks of 2, the last ones too
    dup = samples[1].indexer_topk.copy()
    dup[3, 0] = [1, 1, -1]  # no set: its chunk travels as it is
    samples[1] = _sample(1, 3, 2, indexer_topk=dup)
    cols = samples_to_columns(samples)
    assert cols["indexer_topk"]["codec"] == "chunks" and cols["indexer_topk"]["rows"] == [2] * 5
    assert isinstance(cols["indexer_topk"]["parts"][4], np.ndarray)
    back = samples_from_columns(Codec().decode(Codec().encode(cols)))
    for a, b in zip(samples, back):
        assert _as_sets(a.indexer_topk) == _as_sets(b.indexer_topk)
    assert np.array_equal(back[1].indexer_topk[3], dup[3])
    cols["indexer_topk"] = {**cols["indexer_topk"], "rows": [2, 2, 2, 2, 1]}
    with pytest.raises(SampleError, match="'indexer_topk'.*9"):
        samples_from_columns(cols)


@pytest.mark.parametrize("chunk_slots", [None, 2 * 2 * K])
def test_threads_decode_a_column_to_the_same_rows(monkeypatch, chunk_slots):
    from replayrl.rollout.traces import trace_storage, trace_table
    from replayrl.transport import trace_codec

    monkeypatch.setattr(trace_codec, "_MIN_CHUNK_SLOTS", 1)  # split even these few rows
    if chunk_slots:
        monkeypatch.setattr(trace_storage, "CHUNK_SLOTS", chunk_slots)
    spec = trace_table.spec("indexer_topk")
    rng = np.random.default_rng(4)
    keys = np.concatenate([_keys(9, rng), _keys(6, rng)])
    counts = [9, 6]
    enc = trace_storage.encode_column(spec, keys, counts)
    assert enc["codec"] == ("chunks" if chunk_slots else "sets")
    for threads in (2, 3, 16):
        got = trace_storage.decode_column(spec, enc, counts, threads=threads)
        assert _as_sets(got) == _as_sets(keys)  # against the encoded rows, not the decoder
        assert all((r[r >= 0] == np.sort(r[r >= 0])).all() for r in got.reshape(-1, K))
    with pytest.raises(ValueError, match="threads"):
        trace_storage.decode_column(spec, enc, counts, threads=0)


def _entry_rows(positions: int, rate: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Compressed-entry rows as DeepSeek-V4's CSA indexer gives them (rate ``rate``, top ``k``):
    a query at ``p`` sees the entries ``w < (p + 1) // rate`` and picks ``min(k, seen)`` of them,
    listed by score (here shuffled), ``-1`` after."""
    out = np.full((positions, 1, k), -1, np.int32)
    for p in range(positions):
        seen = (p + 1) // rate
        out[p, 0, :min(k, seen)] = rng.choice(seen, size=min(k, seen), replace=False)
    return out


def test_compressed_entry_rows_draw_from_the_entries_their_query_sees():
    from replayrl.rollout.traces import trace_storage, trace_table
    from replayrl.transport.trace_codec import encoded_nbytes

    spec = trace_table.spec("indexer_topk")
    rows = _entry_rows(12, 4, 2, np.random.default_rng(5))
    enc = trace_storage.encode_column(spec, rows, [12])
    # positions 0..11 see 0 0 0 1 1 1 1 2 2 2 2 3 entries; k = 2: the first three rows are empty,
    # the next eight pick every entry they see (no bytes), the last picks 2 of 3 (a 3-bit bitmap)
    assert enc["stride"] == 4
    assert enc["kind"].tolist() == [0] * 3 + [1] * 8 + [2]
    assert enc["bitmap"].size == 1 and enc["high"].size == 0 and enc["low"].size == 0
    # over p + 1 keys instead, the eight rows that pick every entry they see would be coded rows
    assert encoded_nbytes(enc) < encoded_nbytes(trace_storage.encode_sets(rows, np.arange(1, 13)))
    back = trace_storage.decode_column(spec, Codec().decode(Codec().encode(enc)), [12])
    assert _as_sets(back) == _as_sets(rows)


def test_the_stride_is_the_largest_every_row_fits():
    from replayrl.rollout.traces.trace_storage import entry_stride

    rows = np.array([[[-1, -1]], [[0, -1]], [[1, 0]], [[2, -1]]], np.int32)
    # by hand: rows 1..3 (p = 1, 2, 3) reach index 0, 1, 2: (p + 1) // (top + 1) = 2, 1, 1
    assert entry_stride(rows, np.arange(4)) == 1
    assert entry_stride(rows[1:2], np.array([7])) == 8  # index 0 at p = 7: up to 8 keys an entry
    assert entry_stride(np.full((3, 1, 2), -1, np.int32), np.arange(3)) == 1
    assert entry_stride(np.array([[[5]]], np.int32), np.array([2])) == 1  # past p + 1: no set


def test_a_malformed_stride_is_named():
    from replayrl.rollout.traces import trace_storage, trace_table

    spec = trace_table.spec("indexer_topk")
    rows = _entry_rows(12, 4, 2, np.random.default_rng(5))
    enc = trace_storage.encode_column(spec, rows, [12])
    for bad in (0, "4", 2.0):
        with pytest.raises(ValueError, match="stride"):
            trace_storage.decode_column(spec, {**enc, "stride": bad}, [12])
    with pytest.raises(ValueError, match="universe"):  # stride 2: rows 3..10 'all' of 2 to 5 entries
        trace_storage.decode_column(spec, {**enc, "stride": 2}, [12])
