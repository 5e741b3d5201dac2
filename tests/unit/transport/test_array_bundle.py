"""A weight push travels as one buffer per dtype: unpacking gives back every array exactly,
and a malformed bundle is a DecodeError naming the entry."""
from __future__ import annotations

import numpy as np
import pytest

from replayrl.transport import DecodeError
from replayrl.transport.array_bundle import pack_arrays, unpack_arrays
from replayrl.transport.codec import Codec


def _arrays():
    rng = np.random.default_rng(0)
    return {"a": rng.random((3, 4), dtype=np.float32), "b": np.arange(5, dtype=np.int32),
            "c": rng.random(7, dtype=np.float32), "empty": np.zeros((0, 2), np.float32),
            "scalar": np.full((), 2.5, np.float32)}


def test_round_trip_through_the_codec_is_exact_with_one_buffer_per_dtype():
    arrays = _arrays()
    bundle = pack_arrays(arrays)
    assert [b.dtype for b in bundle["buffers"]] == [np.float32, np.int32]
    assert bundle["buffers"][0].size == 12 + 7 + 0 + 1  # by hand: a, c, empty, scalar
    codec = Codec()
    frames = codec.encode(bundle)
    assert len(frames) <= 3  # header plus at most one frame per buffer, whatever the count
    back = unpack_arrays(codec.decode(frames))
    assert list(back) == list(arrays)
    for name, a in arrays.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape
        assert np.array_equal(back[name], a) and not back[name].flags.writeable


def test_packing_copies_so_later_writes_do_not_change_the_bundle():
    arrays = _arrays()
    bundle = pack_arrays(arrays)
    arrays["a"][0, 0] = -1.0
    assert unpack_arrays(bundle)["a"][0, 0] != -1.0


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b.update(entries=[["a", 0, 0, [3, 4]], ["a", 0, 12, [1]]]), "repeats the name 'a'"),
    (lambda b: b.update(entries=[["a", 5, 0, [3, 4]]]), r"'a': buffer 5 of 2"),
    (lambda b: b.update(entries=[["a", 0, 18, [3, 4]]]), r"'a': elements \[18, 30\) outside"),
    (lambda b: b.update(entries=[["a", 0, 0, [3, -4]]]), "entry 0 must be"),
    (lambda b: b.update(entries=[["a", 0, 0.5, [3]]]), "entry 0 must be"),
    (lambda b: b.update(buffers=[np.zeros((2, 2), np.float32)]), "1-D numpy arrays"),
    (lambda b: b.pop("entries"), "expected a mapping with 'buffers' and 'entries'"),
])
def test_malformed_bundles_are_named(mutate, match):
    bundle = pack_arrays(_arrays())
    mutate(bundle)
    with pytest.raises(DecodeError, match=match):
        unpack_arrays(bundle)
