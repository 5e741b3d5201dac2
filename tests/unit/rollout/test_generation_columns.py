"""One engine reply's generations cross the wire as columns: exact round trip, rows split by
the lengths, and a malformed column named."""
from __future__ import annotations

import numpy as np
import pytest

from replayrl.rollout.engines.base import Generation, generations_from_columns, generations_to_columns
from replayrl.rollout.errors import EngineInputError
from replayrl.transport.codec import Codec


def _gen(P: int, R: int, *, traces: bool = True, finish: str = "stop") -> Generation:
    rng = np.random.default_rng(P * 10 + R)
    return Generation(response_ids=rng.integers(0, 9, R).astype(np.int32),
                      rollout_logprobs=-rng.random(R).astype(np.float32),
                      sample_support=rng.integers(-1, 9, (R, 4)).astype(np.int32) if traces else None,
                      routed_experts=rng.integers(0, 8, (P + R - 1, 3, 2)).astype(np.int32) if traces else None,
                      indexer_topk=None, finish_reason=finish)


def _same(a: Generation, b: Generation) -> None:
    assert a.finish_reason == b.finish_reason
    for name in ("response_ids", "rollout_logprobs", "sample_support", "routed_experts", "indexer_topk"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x, y))


def test_round_trip_through_the_codec():
    gens = [_gen(3, 1), _gen(5, 2, finish="length"), _gen(2, 3)]
    codec = Codec()
    cols = generations_to_columns(gens)
    # by hand: trace rows P + R - 1 = 3, 6, 4
    assert cols["trace_lengths"].tolist() == [3, 6, 4] and cols["routed_experts"]["shape"] == [13, 3, 2]
    for a, b in zip(gens, generations_from_columns(codec.decode(codec.encode(cols)))):
        _same(a, b)


def test_mixed_presence_travels_per_generation():
    gens = [_gen(3, 1), _gen(2, 2, traces=False)]
    cols = generations_to_columns(gens)
    assert isinstance(cols["routed_experts"], list)
    for a, b in zip(gens, generations_from_columns(cols)):
        _same(a, b)


@pytest.mark.parametrize("column, value, match", [
    ("response_ids", np.zeros(2, np.int32), "'response_ids'.*does not hold the 3 rows"),
    ("trace_lengths", np.array([3, -1]), "'trace_lengths'.*non-negative"),
    ("finish_reason", ["stop"], "2 response lengths but 2 trace lengths and 1 finish reasons"),
])
def test_malformed_columns_are_named(column, value, match):
    cols = generations_to_columns([_gen(3, 1), _gen(2, 2)])
    cols[column] = value
    with pytest.raises(EngineInputError, match=match):
        generations_from_columns(cols)


def test_missing_column():
    cols = generations_to_columns([_gen(3, 1)])
    del cols["finish_reason"]
    with pytest.raises(EngineInputError, match="generation columns"):
        generations_from_columns(cols)
