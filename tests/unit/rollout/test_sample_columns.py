"""A batch of samples crosses the wire as columns: the round trip keeps every field, the
columns hold what was put in by hand, and a malformed column is an error naming it."""
from __future__ import annotations

import numpy as np
import pytest

from replayrl.rollout.errors import SampleError
from replayrl.rollout.sample import Sample, samples_from_columns, samples_to_columns
from replayrl.transport.codec import Codec
from replayrl.transport.trace_codec import decode_ids


def _sample(sid: int, P: int, R: int, *, traces: bool = True, width: int = 3, **kw) -> Sample:
    rng = np.random.default_rng(sid)
    support = np.full((R, 1 + width), -1, np.int32)
    support[:, 0] = support[:, 1] = rng.integers(0, 9, R)
    return Sample(sample_id=sid, group_id=sid // 2, rollout_id=4, policy_version=3,
                  prompt_ids=rng.integers(0, 9, P), response_ids=support[:, 0].copy(),
                  loss_mask=np.ones(R, np.uint8), rollout_logprobs=-rng.random(R),
                  reward=sid / 10, sample_support=support if traces else None,
                  routed_experts=rng.integers(0, 8, (P + R - 1, 3, 2)) if traces else None, **kw)


def _same(a: Sample, b: Sample) -> None:
    for name in ("sample_id", "group_id", "rollout_id", "policy_version", "reward", "status",
                 "synthetic_eos"):
        assert getattr(a, name) == getattr(b, name) and type(getattr(a, name)) is type(getattr(b, name))
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "sample_support",
                 "routed_experts", "indexer_topk"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x, y))


def test_round_trip_through_the_codec_keeps_every_field():
    samples = [_sample(0, 3, 1), _sample(1, 5, 4, status="truncated"), _sample(2, 2, 2)]
    codec = Codec()
    back = samples_from_columns(codec.decode(codec.encode(samples_to_columns(samples))))
    assert len(back) == 3
    for a, b in zip(samples, back):
        _same(a, b)


def test_columns_hold_the_ragged_fields_concatenated_in_sample_order():
    a, b = _sample(0, 3, 1), _sample(1, 2, 2)
    cols = samples_to_columns([a, b])
    assert cols["prompt_lengths"].tolist() == [3, 2] and cols["response_lengths"].tolist() == [1, 2]
    assert cols["prompt_ids"].tolist() == a.prompt_ids.tolist() + b.prompt_ids.tolist()
    # routing rows: P + R - 1 = 3 then 3
    # expert ids 0..7 travel as uint8, 6 rows x 3 layers of 2 (no padded row)
    assert cols["routed_experts"]["shape"] == [6, 3, 2]
    assert cols["routed_experts"]["values"].dtype == np.uint8
    assert cols["routed_experts"]["values"].reshape(-1).tolist() == (
        a.routed_experts.reshape(-1).tolist() + b.routed_experts.reshape(-1).tolist())
    assert cols["indexer_topk"] is None
    assert cols["sample_support"].shape == (3, 4)


def test_traces_of_different_widths_or_presence_travel_per_sample():
    samples = [_sample(0, 3, 1, width=3), _sample(1, 2, 2, width=5), _sample(2, 2, 1, traces=False)]
    cols = samples_to_columns(samples)
    assert isinstance(cols["sample_support"], list) and cols["sample_support"][2] is None
    for a, b in zip(samples, samples_from_columns(cols)):
        _same(a, b)


def test_empty_batch():
    assert samples_from_columns(samples_to_columns([])) == []


@pytest.mark.parametrize("column, value, match", [
    ("prompt_ids", np.zeros(4, np.int32), "prompt_ids.*does not hold the 5 rows"),
    ("routed_experts", np.zeros((3, 3, 2), np.int32), "routed_experts.*does not hold the 6 rows"),
    ("response_lengths", np.array([1, -2]), "non-negative"),
    ("reward", np.zeros(3), r"shape \(3,\), expected \(2,\)"),
    ("status", ["completed"], "status.*1 entries for 2 samples"),
    ("sample_id", np.array([0.0, 1.0]), "sample_id.*expected integers, got float64"),
    ("policy_version", np.array([True, True]), "policy_version.*expected integers, got bool"),
])
def test_a_malformed_column_is_named(column, value, match):
    cols = samples_to_columns([_sample(0, 3, 1), _sample(1, 2, 2)])
    cols[column] = value
    with pytest.raises(SampleError, match=match):
        samples_from_columns(cols)


def test_missing_and_unknown_columns_are_named():
    cols = samples_to_columns([_sample(0, 3, 1)])
    with pytest.raises(SampleError, match="'extra'.*unknown column"):
        samples_from_columns({**cols, "extra": 1})
    del cols["loss_mask"]
    with pytest.raises(SampleError, match="'loss_mask'.*missing column"):
        samples_from_columns(cols)


def test_a_sample_breaking_the_contract_is_named_by_its_id():
    cols = samples_to_columns([_sample(7, 3, 1), _sample(8, 2, 2)])
    logp = cols["rollout_logprobs"].copy()
    logp[2] = np.nan  # sample 8's second token, loss-bearing
    with pytest.raises(SampleError, match="sample 8: field 'rollout_logprobs'"):
        samples_from_columns({**cols, "rollout_logprobs": logp})


def _frozen(cols: dict) -> dict:
    for v in cols.values():
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
    return cols


def _mutations(rng: np.random.Generator, cols: dict) -> dict:
    """One random contract violation (or none) applied to a copy of valid columns."""
    cols = {k: (v.copy() if isinstance(v, np.ndarray) else list(v) if isinstance(v, list) else v)
            for k, v in cols.items()}
    kind = rng.integers(0, 9)
    R, n = cols["response_lengths"], len(cols["response_lengths"])
    row = int(rng.integers(0, len(cols["loss_mask"])))
    if kind == 0:
        cols["loss_mask"][row] = 2
    elif kind == 1:
        cols["rollout_logprobs"][row] = rng.choice([np.nan, np.inf])
    elif kind == 2:
        cols["loss_mask"][row] = 0
        cols["rollout_logprobs"][row] = np.nan  # allowed: not loss-bearing
    elif kind == 3:
        cols["sample_support"][row, 1:] = -1  # loss-bearing without support (EOS only if last)
    elif kind == 4:
        cols["synthetic_eos"][int(rng.integers(0, n))] = True
    elif kind == 5:
        i = int(rng.integers(0, n))
        cols["synthetic_eos"][i] = True  # a proper synthetic EOS: last row without candidates
        cols["sample_support"][int(np.cumsum(R)[i]) - 1, 1:] = -1
    elif kind == 6:
        cols["status"][int(rng.integers(0, n))] = rng.choice(["completed", "aborted", "lost"])
    elif kind == 7:
        cols["reward"][int(rng.integers(0, n))] = rng.choice([0.5, np.nan])
    return cols


def test_the_column_path_and_per_sample_construction_agree():
    """samples_from_columns checks the contract once per batch with the same check Sample
    makes per sample: both accept the same batches and refuse the others with the same error
    (first bad sample, its field, the message)."""
    rng = np.random.default_rng(0)
    base = samples_to_columns([_sample(i, 2 + i % 3, 1 + i % 4) for i in range(6)])
    seen = set()
    for _ in range(300):
        cols = _frozen(_mutations(rng, base))
        try:
            [Sample(**kw) for kw in _per_sample_fields(cols)]
            expected = None
        except SampleError as exc:
            expected = str(exc)
        seen.add(expected is None)
        if expected is None:
            assert len(samples_from_columns(cols)) == 6
        else:
            with pytest.raises(SampleError) as info:
                samples_from_columns(cols)
            assert str(info.value) == expected
    assert seen == {True, False}


def _per_sample_fields(cols: dict) -> list[dict]:
    P, R = cols["prompt_lengths"], cols["response_lengths"]
    cut = lambda a, counts: np.split(a, np.cumsum(counts)[:-1])
    rows = {"prompt_ids": P, "response_ids": R, "loss_mask": R, "rollout_logprobs": R,
            "sample_support": R, "routed_experts": P + R - 1}
    plain = {**cols, "routed_experts": decode_ids(cols["routed_experts"])}  # stored narrowed
    parts = {k: cut(plain[k], c) for k, c in rows.items()}
    return [dict(sample_id=int(cols["sample_id"][i]), group_id=int(cols["group_id"][i]),
                 rollout_id=int(cols["rollout_id"][i]), policy_version=int(cols["policy_version"][i]),
                 reward=float(cols["reward"][i]), synthetic_eos=bool(cols["synthetic_eos"][i]),
                 status=cols["status"][i], indexer_topk=None, **{k: v[i] for k, v in parts.items()})
            for i in range(len(P))]


def test_plain_columns_keep_every_trace_as_its_int32_rows():
    # the REPL's sample() reads these (RolloutManager.last_sample): no compact wire form
    a, b = _sample(1, 3, 4), _sample(2, 2, 5)
    cols = samples_to_columns([a, b], compact=False)
    assert cols["indexer_topk"] is None  # no sample has it
    for name in ("routed_experts", "sample_support"):
        expected = np.concatenate([getattr(a, name), getattr(b, name)])
        assert isinstance(cols[name], np.ndarray) and cols[name].dtype == np.int32
        np.testing.assert_array_equal(cols[name], expected)
    for got, want in zip(samples_from_columns(cols), (a, b)):
        _same(got, want)


def _indexed_sample(sid: int, P: int, R: int, layers: int = 2, k: int = 6) -> Sample:
    """A sample whose indexer rows hold valid key sets: row p picks up to ``k`` of its p + 1
    keys in random order, -1 padding anywhere."""
    rng = np.random.default_rng(100 + sid)
    keys = np.full((P + R - 1, layers, k), -1, np.int32)
    for p in range(P + R - 1):
        for layer in range(layers):
            picked = rng.permutation(p + 1)[:rng.integers(0, min(k, p + 1) + 1)]
            keys[p, layer, rng.permutation(k)[:len(picked)]] = picked
    return _sample(sid, P, R, indexer_topk=keys)


def _naive_key_sets(rows: np.ndarray) -> np.ndarray:
    """Per row, in plain Python: the key positions ascending, then -1."""
    out = [sorted(v for v in row if v >= 0) for row in rows.reshape(-1, rows.shape[-1]).tolist()]
    return np.array([r + [-1] * (rows.shape[-1] - len(r)) for r in out], np.int32).reshape(rows.shape)


@pytest.mark.parametrize("chunk_slots", [None, 40])  # one "sets" column, or "chunks" of rows
def test_indexer_traces_decode_alike_on_one_or_more_threads(monkeypatch, chunk_slots):
    from replayrl.rollout.traces import trace_storage
    from replayrl.transport import trace_codec

    monkeypatch.setattr(trace_codec, "_MIN_CHUNK_SLOTS", 1)  # a chunk of rows per thread, however small
    if chunk_slots:
        monkeypatch.setattr(trace_storage, "CHUNK_SLOTS", chunk_slots)
    seen = []

    def decode_sets(*args, threads=1, **kwargs):
        seen.append(threads)
        return trace_codec.decode_sets(*args, threads=threads, **kwargs)

    monkeypatch.setattr(trace_storage, "decode_sets", decode_sets)
    samples = [_indexed_sample(0, 9, 4), _indexed_sample(1, 5, 7), _indexed_sample(2, 12, 3)]
    codec = Codec()
    cols = codec.decode(codec.encode(samples_to_columns(samples)))
    assert cols["indexer_topk"]["codec"] == ("chunks" if chunk_slots else "sets")  # something to decode
    one = samples_from_columns(cols)
    two = samples_from_columns(cols, decode_threads=2)
    assert set(seen) == {1, 2}  # the keyword reached the decoder
    for s, a, b in zip(samples, one, two):
        want = _naive_key_sets(s.indexer_topk)
        assert np.array_equal(a.indexer_topk, want) and np.array_equal(b.indexer_topk, want)


@pytest.mark.parametrize("threads", [0, 1.5, "2"])
def test_a_bad_decode_thread_count_is_named(threads):
    cols = samples_to_columns([_sample(0, 3, 1)])
    with pytest.raises(SampleError, match="decode_threads"):
        samples_from_columns(cols, decode_threads=threads)
