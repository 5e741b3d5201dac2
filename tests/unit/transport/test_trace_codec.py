"""Compact trace storage: ids narrowed and index sets coded round-trip exactly (property tests
against a per-row Python reference), hand-worked encodings, and malformed encodings refused."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replayrl.transport import trace_codec
from replayrl.transport.codec import Codec
from replayrl.transport.trace_codec import (
    ALL,
    BITMAP,
    ELIAS_FANO,
    EMPTY,
    TraceCodecError,
    decode_ids,
    decode_sets,
    encode_ids,
    encode_sets,
)


def _reference_canonical(a: np.ndarray) -> np.ndarray:
    """Per row, in plain Python: the indices ascending, then -1."""
    flat = a.reshape(-1, a.shape[-1])
    out = [sorted(v for v in row.tolist() if v >= 0) for row in flat]
    out = [r + [-1] * (a.shape[-1] - len(r)) for r in out]
    return np.array(out, dtype=np.int32).reshape(a.shape)


@st.composite
def causal_traces(draw):
    """int32 [N, L, K] key positions: row p draws from p + 1 keys (offset by ``start``, as
    a trajectory's rows are), rows empty, full, single, k = K or random, -1 slots anywhere."""
    n = draw(st.integers(0, 40))
    layers = draw(st.integers(1, 3))
    k = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    out = np.full((n, layers, k), -1, np.int32)
    for p in range(n):
        keys = p + 1
        for layer in range(layers):
            how = draw(st.sampled_from(["empty", "all", "one", "max", "random", "window"]))
            top = min(k, keys)
            c = {"empty": 0, "all": top, "one": 1, "max": top, "window": top,
                 "random": int(rng.integers(0, top + 1))}[how]
            if how == "window":
                chosen = np.arange(keys - c, keys)
            else:
                chosen = rng.choice(keys, size=c, replace=False)
            slots = rng.permutation(k)[:c]
            out[p, layer, slots] = chosen
    return out


@settings(max_examples=150, deadline=None)
@given(causal_traces())
def test_sets_round_trip_to_the_canonical_rows(trace):
    universe = np.arange(len(trace)) + 1
    encoded = encode_sets(trace, universe)
    assert encoded is not None
    back = decode_sets(Codec().decode(Codec().encode(encoded)), universe)
    assert back.dtype == np.int32 and np.array_equal(back, _reference_canonical(trace))
    assert np.array_equal(decode_sets(encoded, universe, threads=3), back)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 64), st.integers(0, 2**32 - 1))
def test_long_rows_round_trip_whichever_form_is_chosen(keys, k, seed):
    """Universes far larger than the row (delta codes) and close to it (bitmap)."""
    rng = np.random.default_rng(seed)
    trace = np.full((3, 1, k), -1, np.int32)
    for i, u in enumerate((keys, max(1, keys // 50), keys)):
        c = min(k, u)
        trace[i, 0, :c] = rng.choice(u, size=c, replace=False)
    universe = np.array([keys, max(1, keys // 50), keys])
    back = decode_sets(encode_sets(trace, universe), universe)
    assert np.array_equal(back, _reference_canonical(trace))


def test_a_row_selecting_every_key_it_sees_costs_no_bytes():
    # rows p = 0..3 of a trajectory with K = 4: row p selects all p + 1 keys, in any order
    trace = np.array([[[0, -1, -1, -1]], [[1, 0, -1, -1]], [[-1, 2, 0, 1]], [[3, 1, 2, 0]]], np.int32)
    enc = encode_sets(trace, np.arange(1, 5))
    assert enc["kind"].tolist() == [ALL] * 4
    assert sum(enc[name].size for name in ("count", "width", "bitmap", "high", "low")) == 0


def test_a_short_universe_takes_the_bitmap_worked_by_hand():
    # universe 10, set {2, 5, 9}: bitmap 0010010001 (10 bits) beats Elias-Fano (at best l = 0:
    # 3 ones + 10 bucket ends, + 8 for l)
    enc = encode_sets(np.array([[[9, 2, 5]]], np.int32), np.array([10]))
    assert enc["kind"].tolist() == [BITMAP] and enc["count"].tolist() == [3]
    assert enc["bitmap"].tolist() == [0b00100100, 0b01000000]


def test_a_sparse_row_takes_elias_fano_worked_by_hand():
    # universe 1000, set {0, 1, 500, 999}, c = 4. Width l costs c + (999 >> l) + 1 high bits and
    # l planes of one byte: l = 8 -> 8 + 64 = 72, l = 7 -> 12 + 56 = 68, l = 6 -> 20 + 48 = 68
    # (the tie goes to the larger l); far below the 1000-bit bitmap.
    enc = encode_sets(np.array([[[999, 0, 500, 1]]], np.int32), np.array([1000]))
    assert enc["kind"].tolist() == [ELIAS_FANO] and enc["width"].tolist() == [7]
    # buckets (s >> 7) 0, 0, 3, 7 of 8: "110" "0" "0" "10" "0" "0" "0" "10" = 1100 0100 0010
    assert enc["high"].tolist() == [0b11000100, 0b00100000]
    # low 7 bits 0, 1, 116 (1110100), 103 (1100111): planes bit 0 .. bit 6, 4 bits + padding each
    assert enc["low"].tolist() == [0b01010000, 0b00010000, 0b00110000, 0, 0b00100000, 0b00110000,
                                   0b00110000]
    assert decode_sets(enc, np.array([1000])).tolist() == [[[0, 1, 500, 999]]]


def test_an_empty_row_and_no_rows():
    enc = encode_sets(np.full((2, 1, 3), -1, np.int32), np.array([5, 6]))
    assert enc["kind"].tolist() == [EMPTY, EMPTY]
    empty = encode_sets(np.zeros((0, 2, 3), np.int32), np.zeros(0, np.int64))
    assert decode_sets(empty, np.zeros(0, np.int64)).shape == (0, 2, 3)


@pytest.mark.parametrize("row, why", [([3, 3, -1], "repeated"), ([0, 7, -1], "outside"),
                                      ([0, -2, 1], "below -1")])
def test_what_is_no_set_of_its_universe_is_left_to_the_caller(row, why):
    assert encode_sets(np.array([[row]], np.int32), np.array([5])) is None, why


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 30), st.integers(1, 8), st.sampled_from([1, 8, 256, 257, 70000]),
       st.sampled_from(["none", "rows", "slots"]), st.integers(0, 2**32 - 1))
def test_ids_round_trip_exactly_in_the_smallest_dtype(n, k, experts, padding, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, experts, (n, 2, k)).astype(np.int32)
    if padding == "rows" and n:
        ids[rng.integers(0, n, max(1, n // 3))] = -1
    if padding == "slots" and n:
        ids[0, 0, 0] = -1
    enc = encode_ids(ids)
    back = decode_ids(Codec().decode(Codec().encode(enc)))
    assert back.dtype == np.int32 and np.array_equal(back, ids)
    top = int(ids.max()) + (1 if enc["codec"] == "ids+1" else 0) if ids.size else 0
    want = np.uint8 if top <= 255 else np.uint16 if top <= 65535 else np.uint32
    assert enc["values"].dtype == want


def test_256_experts_fit_uint8_with_padded_rows():
    ids = np.array([[[255, 0]], [[-1, -1]], [[7, 200]]], np.int32)
    enc = encode_ids(ids)
    assert enc["values"].dtype == np.uint8 and enc["values"].tolist() == [[255, 0], [7, 200]]
    assert np.unpackbits(enc["pad_rows"], count=3).tolist() == [0, 1, 0]
    assert decode_ids(enc).tolist() == ids.tolist()


@pytest.mark.parametrize("part, value", [
    ("kind", np.array([9], np.uint8)), ("count", np.array([5, 5], np.uint16)),
    ("high", np.array([255, 255], np.uint8)), ("low", np.zeros(0, np.uint8)),
    ("bitmap", np.array([1], np.int32))])
def test_malformed_sets_are_refused_naming_the_part(part, value):
    enc = encode_sets(np.array([[[999, 0, 500, 1]]], np.int32), np.array([1000]))
    enc[part] = value
    with pytest.raises(TraceCodecError):
        decode_sets(enc, np.array([1000]))


def _naive_decode_sets(enc, universe) -> np.ndarray:
    """Per row in plain Python, from the layout the module docstring gives: bitmap rows read
    ``n`` bits each; Elias-Fano rows walk their high bits (a 1 is an index in the current
    bucket, a 0 ends the bucket) and take their low bits from the planes (plane b: bit b of
    every row wider than b, each row's plane padded to whole bytes)."""
    shape = enc["shape"]
    k = shape[-1]
    per = int(np.prod(shape[1:-1]))
    n = [int(u) for u in universe for _ in range(per)]
    bitmap, high, low = (np.unpackbits(enc[name]).tolist() for name in ("bitmap", "high", "low"))
    counts, widths = iter(enc["count"].tolist()), iter(enc["width"].tolist())
    rows, ef = [], []  # ef: (row, count, width, highs)
    bm_at = hi_at = 0
    for r, kind in enumerate(enc["kind"].tolist()):
        if kind == EMPTY:
            rows.append([])
        elif kind == ALL:
            rows.append(list(range(n[r])))
        elif kind == BITMAP:
            c = next(counts)
            rows.append([i for i in range(n[r]) if bitmap[bm_at + i]])
            assert len(rows[-1]) == c
            bm_at += n[r]
        else:
            c, w = next(counts), next(widths)
            bucket, highs = 0, []
            for bit in high[hi_at:hi_at + c + ((n[r] - 1) >> w) + 1]:
                if bit:
                    highs.append(bucket)
                else:
                    bucket += 1
            hi_at += c + ((n[r] - 1) >> w) + 1
            ef.append((r, c, w, highs))
            rows.append(None)
    lows = {r: [0] * c for r, c, _, _ in ef}
    at = 0
    for b in range(max([w for _, _, w, _ in ef], default=0)):
        for r, c, w, _ in ef:
            if w > b:
                for j in range(c):
                    lows[r][j] |= low[at + j] << b
                at += (c + 7) // 8 * 8
    for r, _, w, highs in ef:
        rows[r] = [(h << w) | lo for h, lo in zip(highs, lows[r])]
    return np.array([row + [-1] * (k - len(row)) for row in rows], np.int32).reshape(shape)


def _mixed_trace(rng, universes, k, full_only):
    """int32 [len(universes), 2, K]: per row a random set of min(K, n) keys (or fewer, when
    not ``full_only``), in random slot order."""
    out = np.full((len(universes), 2, k), -1, np.int32)
    for i, n in enumerate(universes):
        for layer in range(2):
            c = min(k, n) if full_only else int(rng.integers(0, min(k, n) + 1))
            out[i, layer, rng.permutation(k)[:c]] = rng.choice(n, size=c, replace=False)
    return out


@pytest.mark.parametrize("universes, k, full_only", [
    ([3000, 3100, 5000, 9000], 64, True),  # every row full: Elias-Fano rows consecutive, in place
    ([70, 3000, 40, 5000, 64, 9000], 64, True),  # 'all' and bitmap rows between them
    ([70, 3000, 40, 5000, 64, 9000, 1], 64, False),  # partial and empty rows
    ([1 << 12, 1 << 20, 1 << 26], 4, True),  # widths above 8 and 16 (uint16, uint32 planes)
])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_decoding_matches_a_naive_decoder_of_the_documented_layout(universes, k, full_only, threads, monkeypatch):
    monkeypatch.setattr(trace_codec, "_MIN_CHUNK_SLOTS", 1)
    trace = _mixed_trace(np.random.default_rng(len(universes) * k), universes, k, full_only)
    universe = np.array(universes)
    enc = encode_sets(trace, universe)
    assert ELIAS_FANO in enc["kind"].tolist()
    want = _naive_decode_sets(enc, universe)
    assert np.array_equal(want, _reference_canonical(trace))
    assert np.array_equal(decode_sets(enc, universe, threads=threads), want)
    assert np.array_equal(decode_sets(enc, universe, np.int64, threads=threads), want)


def test_threads_split_rows_mid_stream_and_agree_with_the_naive_decoder(monkeypatch):
    monkeypatch.setattr(trace_codec, "_MIN_CHUNK_SLOTS", 1)  # a chunk per thread, however small
    # chunk boundaries fall inside every stream: bitmap and high bits not byte-aligned, each
    # low plane's rows split, 'all' and empty rows in between
    rng = np.random.default_rng(7)
    universes = rng.integers(1, 3000, size=23)
    universes[[4, 11]] = 30  # rows that may select all their keys
    trace = _mixed_trace(rng, universes, 40, False)
    trace[4, 0] = -1  # an empty row
    trace[11, 1] = np.concatenate([np.arange(30)[::-1], np.full(10, -1)])  # all 30 keys
    enc = encode_sets(trace, universes)
    assert {EMPTY, ALL, BITMAP, ELIAS_FANO} <= set(enc["kind"].tolist())
    want = _naive_decode_sets(enc, universes)
    for threads in range(1, 50, 3):  # up to more threads than rows
        out = np.full(trace.shape, 7, np.int32)
        decode_sets(enc, universes, out=out, threads=threads)
        assert np.array_equal(out, want), threads


@pytest.mark.parametrize("threads", [0, -1, 1.5, "2"])
def test_bad_thread_counts_are_refused(threads):
    enc = encode_sets(np.array([[[3, 0]]], np.int32), np.array([9]))
    with pytest.raises(TraceCodecError, match="threads"):
        decode_sets(enc, np.array([9]), threads=threads)


def test_a_malformed_stream_is_refused_from_a_decoding_thread(monkeypatch):
    monkeypatch.setattr(trace_codec, "_MIN_CHUNK_SLOTS", 1)
    trace = _mixed_trace(np.random.default_rng(5), [3000] * 8, 16, True)
    enc = encode_sets(trace, np.full(8, 3000))
    enc["high"] = np.zeros_like(enc["high"])  # no ones: every chunk's count disagrees
    with pytest.raises(TraceCodecError, match="high stream"):
        decode_sets(enc, np.full(8, 3000), threads=4)


def test_decoding_into_a_slice_of_a_larger_output():
    trace = _mixed_trace(np.random.default_rng(3), [9, 3000, 5000], 16, False)
    universe = np.array([9, 3000, 5000])
    enc = encode_sets(trace, universe)
    big = np.full((5, 2, 16), 7, np.int32)
    got = decode_sets(enc, universe, out=big[1:4])
    assert got.base is big and np.array_equal(big[1:4], _reference_canonical(trace))
    assert (big[0] == 7).all() and (big[4] == 7).all()  # rows outside the slice untouched
    for bad in (np.zeros((3, 2, 16), np.uint32), np.zeros((3, 2, 15), np.int32),
                np.zeros((3, 2, 16), np.int32)[:, :, ::-1]):
        with pytest.raises(TraceCodecError, match="out must be"):
            decode_sets(enc, universe, out=bad)


def test_threads_on_rows_large_enough_to_be_split_by_default():
    # 72 rows of K = 2048 are 2.25 x _MIN_CHUNK_SLOTS slots: two threads each take a chunk
    rng = np.random.default_rng(11)
    universes = rng.integers(2049, 40000, size=72)
    trace = _mixed_trace(rng, universes, 2048, True)[:, :1]
    enc = encode_sets(trace, universes)
    assert trace.size >= 2 * trace_codec._MIN_CHUNK_SLOTS
    assert np.array_equal(decode_sets(enc, universes, threads=2), _reference_canonical(trace))
