"""The torch decoder of index sets gives what the numpy decoder gives (and what a per-row Python
reference gives), on CPU; malformed encodings are refused. Not run on a GPU here."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replayrl.trainer.replay.trace_decode import decode_sets_torch
from replayrl.transport.trace_codec import TraceCodecError, decode_sets, encode_sets


def _reference_canonical(a: np.ndarray) -> np.ndarray:
    """Per row, in plain Python: the indices ascending, then -1."""
    flat = a.reshape(-1, a.shape[-1])
    out = [sorted(v for v in row.tolist() if v >= 0) for row in flat]
    return np.array([r + [-1] * (a.shape[-1] - len(r)) for r in out], np.int32).reshape(a.shape)


def _random_trace(universes: list[int], k: int, full: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """An int32 trace ``[len(universes), 2, k]`` (two layers): row ``i`` holds distinct indices
    of ``[0, universes[i])`` at random slots, ``min(k, n)`` of them when ``full`` else a random
    count, -1 elsewhere; and the int64 universes."""
    rng = np.random.default_rng(seed)
    trace = np.full((len(universes), 2, k), -1, np.int32)
    for i, n in enumerate(universes):
        for layer in range(2):
            c = min(k, n) if full else int(rng.integers(0, min(k, n) + 1))
            trace[i, layer, rng.permutation(k)[:c]] = rng.choice(n, size=c, replace=False)
    return trace, np.array(universes, np.int64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=0, max_size=8), st.integers(1, 40),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_torch_decoding_matches_numpy_and_the_reference(universes, k, full, seed):
    trace, universe = _random_trace(universes, k, full, seed)
    enc = encode_sets(trace, universe)
    got = decode_sets_torch(enc, universe)
    assert got.dtype == torch.int32 and got.device.type == "cpu"
    assert np.array_equal(got.numpy(), _reference_canonical(trace))
    assert np.array_equal(got.numpy(), decode_sets(enc, universe))


def test_wide_universes_and_int64():
    trace = np.array([[[5, 1 << 25, 77, -1]], [[3, 2, 1, 0]], [[-1, -1, -1, -1]]], np.int32)
    universe = np.array([1 << 26, 4, 9])
    got = decode_sets_torch(encode_sets(trace, universe), universe, dtype=torch.int64)
    assert got.dtype == torch.int64
    assert got.tolist() == [[[5, 77, 1 << 25, -1]], [[0, 1, 2, 3]], [[-1, -1, -1, -1]]]


@pytest.mark.parametrize("part, value", [
    ("high", np.array([255, 255], np.uint8)), ("low", np.zeros(0, np.uint8)),
    ("count", np.array([5], np.uint16))])
def test_malformed_encodings_are_refused(part, value):
    enc = encode_sets(np.array([[[999, 0, 500, 1]]], np.int32), np.array([1000]))
    enc[part] = value
    with pytest.raises(TraceCodecError):
        decode_sets_torch(enc, np.array([1000]))


def test_an_index_outside_its_universe_is_refused():
    # the same bytes read against a smaller universe: the last index (999) is outside [0, 960)
    enc = encode_sets(np.array([[[999, 0, 500, 1]]], np.int32), np.array([1000]))
    with pytest.raises(TraceCodecError):
        decode_sets_torch(enc, np.array([960]))
    with pytest.raises(TraceCodecError):
        decode_sets(enc, np.array([960]))


@pytest.mark.parametrize("universes, k, full", [
    ([3000, 3100, 5000, 9000], 64, True),  # full rows of a multiple of 8 slots: no scatter
    ([70, 3000, 40, 5000, 64, 9000, 1], 64, False),  # 'all', bitmap, partial and empty rows
    ([1 << 12, 1 << 20, 1 << 26], 8, True),  # widths above 8 and 16
    ([5000, 7000, 2000], 13, True),  # full rows whose planes end mid-byte
])
def test_blocks_of_mixed_kinds_and_widths_match_the_reference(universes, k, full):
    trace, universe = _random_trace(universes, k, full, k + len(universes))
    enc = encode_sets(trace, universe)
    assert len(set(enc["width"].tolist())) > 1  # rows of several widths
    assert np.array_equal(decode_sets_torch(enc, universe).numpy(), _reference_canonical(trace))
