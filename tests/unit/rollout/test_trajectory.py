"""Trajectory transformations (rollout/traces/trajectory.py) against hand-built samples and trace_alignment.json."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from replayrl.rollout.errors import CaptureError, MissingTraceError, SampleError, TraceGapError, TrajectoryError
from replayrl.rollout.sample import Sample
from replayrl.rollout.traces.trajectory import append_synthetic_eos, merge_turns, truncate
from replayrl.trainer.rejection.rs_gates import compute_log_ratio, sample_gate, sequence_log_weight
from tests.paths import CASES

CASES = {c["name"]: c for c in json.loads((CASES / "trace_alignment.json").read_text())}
SID = 11
L, K, L_IDX, K_IDX = 2, 2, 1, 3


def position_rows(n, tag):
    """``n`` per-position rows [n, L, K] whose values encode (tag, position): 1000*tag + 10*t + j."""
    t = np.arange(n)[:, None, None]
    j = np.arange(L * K).reshape(1, L, K)
    return 1000 * tag + 10 * t + j


def make_sample(P, R, W=3, **overrides):
    """A valid single-turn sample: prompt 1..P, response 3..3+R, distinct trace values."""
    response = np.arange(3, 3 + R)
    support = np.full((R, 1 + W), -1)
    support[:, 0] = response
    support[:, 1] = response
    support[:, 2] = 40
    fields = dict(sample_id=SID, group_id=1, rollout_id=2, policy_version=3,
                  prompt_ids=np.arange(1, P + 1), response_ids=response,
                  loss_mask=np.ones(R, np.uint8), rollout_logprobs=-0.25 * np.arange(1, R + 1),
                  sample_support=support, routed_experts=position_rows(P + R - 1, 0),
                  indexer_topk=np.arange((P + R - 1) * L_IDX * K_IDX).reshape(P + R - 1, L_IDX, K_IDX),
                  status="completed")
    fields.update(overrides)
    return Sample(**fields)


# ------------------------------------------------------------------------------ truncate


def test_truncate_keeps_traces_aligned():
    case = CASES["truncate_keeps_traces_aligned"]
    P, R, n = case["prompt_len"], case["response_len"], case["truncate_to"]
    s = make_sample(P, R)
    t = truncate(s, n)
    assert len(t.response_ids) == len(t.loss_mask) == len(t.rollout_logprobs) == n
    assert t.sample_support.shape[0] == case["expected_support_rows"] == 7
    assert t.routed_experts.shape[0] == t.indexer_topk.shape[0] == case["expected_routed_rows"] == 12
    # The kept rows are the first ones, unchanged: response 3..9, positions 0..11.
    assert t.response_ids.tolist() == list(range(3, 10))
    assert t.rollout_logprobs.tolist() == [-0.25 * k for k in range(1, 8)]
    assert np.array_equal(t.sample_support, s.sample_support[:7])
    assert np.array_equal(t.routed_experts, position_rows(12, 0))
    assert t.indexer_topk.reshape(-1).tolist() == list(range(12 * L_IDX * K_IDX))
    assert t.status == "truncated" and t.sample_id == SID and t.reward == s.reward
    assert len(s.response_ids) == 12  # the input is untouched


def test_truncate_to_at_least_the_length_returns_the_sample():
    s = make_sample(4, 5)
    assert truncate(s, 5) is s and truncate(s, 9) is s


def test_truncate_keeps_aborted_and_drops_a_synthetic_eos():
    s = append_synthetic_eos(make_sample(4, 5, status="aborted"), eos_id=2)
    t = truncate(s, 3)
    assert t.status == "aborted" and not t.synthetic_eos
    assert t.routed_experts.shape[0] == 4 + 3 - 1


@pytest.mark.parametrize("n", [-1, 2.0, True])
def test_truncate_length_must_be_a_non_negative_int(n):
    with pytest.raises(TrajectoryError) as info:
        truncate(make_sample(4, 5), n)
    assert info.value.sample_id == SID and info.value.field == "max_response_len"


# ------------------------------------------------------------------------- synthetic EOS


def test_truncated_then_synthetic_eos():
    case = CASES["truncated_then_synthetic_eos"]
    P, eos = 3, case["response_ids"][-1]
    s = make_sample(P, 6, W=case["top_k"])
    s = truncate(s, 4)  # "response hits max length after 4 sampled tokens"
    assert s.response_ids.tolist() == [3, 4, 5, 6]
    s = Sample(**{**s.to_dict(), "response_ids": [5, 6, 7, 8],
                  "sample_support": [[5, 5, 40, -1], [6, 6, 40, -1], [7, 7, 40, -1], [8, 8, 40, -1]]})
    e = append_synthetic_eos(s, eos)
    assert e.synthetic_eos is True and case["synthetic_eos"]
    assert e.response_ids.tolist() == case["response_ids"]
    assert e.loss_mask.tolist() == case["loss_mask"]
    assert e.sample_support.shape[0] == case["expected_support_rows"]
    assert e.sample_support[-1].tolist() == case["expected_last_row"]
    assert e.sample_support[:4].tolist() == s.sample_support.tolist()
    assert e.rollout_logprobs[-1] == 0.0 and np.isfinite(e.rollout_logprobs).all()
    assert e.rollout_logprobs[:4].tolist() == s.rollout_logprobs.tolist()
    # One more per-position row: position P+4-1 = 6, the old last token, never forwarded.
    assert e.routed_experts.shape[0] == P + 5 - 1
    assert (e.routed_experts[-1] == -1).all() and (e.indexer_topk[-1] == -1).all()
    assert np.array_equal(e.routed_experts[:-1], s.routed_experts)
    assert e.status == s.status


def test_two_unsupported_rows():
    s = append_synthetic_eos(make_sample(3, 4), eos_id=2)
    with pytest.raises(TrajectoryError) as info:
        append_synthetic_eos(s, eos_id=1)
    assert info.value.sample_id == SID and info.value.field == "synthetic_eos"
    # Built by hand, two loss-bearing rows without candidates are refused by the contract.
    support = s.sample_support.copy()
    support[1, 1:] = -1
    with pytest.raises(SampleError) as info:
        Sample(**{**s.to_dict(), "sample_support": support})
    assert info.value.sample_id == SID and "at most one synthetic EOS" in str(info.value)


def test_synthetic_eos_after_a_sampled_eos_is_refused():
    s = make_sample(3, 4, response_ids=[3, 4, 5, 2],
                    sample_support=[[3, 3, -1, -1], [4, 4, -1, -1], [5, 5, -1, -1], [2, 2, -1, -1]])
    with pytest.raises(TrajectoryError) as info:
        append_synthetic_eos(s, eos_id=2)
    assert info.value.field == "response_ids"


def test_synthetic_eos_without_traces():
    s = make_sample(3, 2, sample_support=None, routed_experts=None, indexer_topk=None)
    e = append_synthetic_eos(s, eos_id=2)
    assert e.response_ids.tolist() == [3, 4, 2] and e.synthetic_eos
    assert e.sample_support is None and e.routed_experts is None


# -------------------------------------------------------------------------------- merge

P = 5


def turn(context_len, ids, tag, *, logprobs=None, finish="length", routed=True, indexer=True,
         support=True, route_start=0):
    """An engine turn over a context of ``context_len`` tokens; trace rows encode (tag, position)."""
    R = len(ids)
    rows = context_len + R - 1
    record = {"response_ids": np.array(ids),
              "rollout_logprobs": np.array(logprobs if logprobs is not None else [-0.5] * R, np.float32),
              "finish_reason": finish}
    if support:
        record["sample_support"] = np.array([[y, y, 40, -1] for y in ids])
    if routed:
        record["routed_experts"] = position_rows(rows, tag)[route_start:]
    if indexer:
        record["indexer_topk"] = np.full((rows, L_IDX, K_IDX), tag)[route_start:]
    if route_start:
        record["route_start"] = route_start
    return record


PROMPT = [1, 13, 5, 6, 17]


def two_turns(**second):
    """Turn 0 (3 tokens), a 4-token observation, turn 1 (2 tokens): case multi_turn_observation_rows."""
    t0 = turn(P, [9, 4, 7], tag=1)
    t1 = turn(P + 3 + 4, [8, 2], tag=2, finish="stop", **second)
    return [t0, t1], [[14, 6, 17, 3]]


def test_multi_turn_observation_rows():
    case = CASES["multi_turn_observation_rows"]
    turns, obs = two_turns()
    m = merge_turns(PROMPT, turns, obs, sample_id=SID)
    assert m.response_ids.tolist() == [9, 4, 7, 14, 6, 17, 3, 8, 2]
    assert m.loss_mask.tolist() == case["loss_mask"]
    assert m.sample_support.shape[0] == case["expected_support_rows"] == 9
    observation = m.loss_mask == 0
    assert (m.sample_support[observation] == -1).all() and case["expected_observation_rows_all_minus_one"]
    assert m.sample_support[~observation].tolist() == [[y, y, 40, -1] for y in [9, 4, 7, 8, 2]]
    assert m.rollout_logprobs[observation].tolist() == [0.0] * 4
    assert m.rollout_logprobs[~observation].tolist() == [-0.5] * 5
    # Positions 0..6 (prompt + turn 0 minus its last token) from turn 0; positions 7..12 (the
    # last token of turn 0, the 4 observation tokens, the first token of turn 1) from turn 1.
    assert m.routed_experts.shape == (P + 9 - 1, L, K)
    expected = np.concatenate([position_rows(7, 1), position_rows(13, 2)[7:]])
    assert np.array_equal(m.routed_experts, expected)
    assert m.indexer_topk[:7].tolist() == np.full((7, L_IDX, K_IDX), 1).tolist()
    assert (m.indexer_topk[7:] == 2).all()
    assert (m.finish_reason, m.num_turns, m.dropped_turns) == ("stop", 2, 0)
    s = Sample(sample_id=SID, group_id=0, rollout_id=0, policy_version=0, prompt_ids=PROMPT,
               **m.sample_fields())
    assert s.total_length == P + 9
    for arr in (m.response_ids, m.loss_mask, m.rollout_logprobs, m.sample_support, m.routed_experts):
        assert not arr.flags.writeable


def test_route_start_from_an_external_engine_gives_the_same_rows():
    turns, obs = two_turns()
    full = merge_turns(PROMPT, turns, obs, sample_id=SID)
    turns_offset, _ = two_turns(route_start=P + 3 - 1)  # rows only from what turn 1 must supply
    part = merge_turns(PROMPT, turns_offset, obs, sample_id=SID)
    assert np.array_equal(part.routed_experts, full.routed_experts)
    assert np.array_equal(part.indexer_topk, full.indexer_topk)
    late, _ = two_turns(route_start=P + 3)  # position 7 would be covered by no turn
    with pytest.raises(TrajectoryError) as info:
        merge_turns(PROMPT, late, obs, sample_id=SID)
    assert info.value.field == "route_start"


def test_merge_stops_at_trace_gap():
    turns, obs = two_turns(routed=False)  # turn 1 truncated and returned no routed_experts
    with pytest.raises(TraceGapError) as info:
        merge_turns(PROMPT, turns, obs, sample_id=SID)
    assert info.value.sample_id == SID and info.value.field == "routed_experts"
    m = merge_turns(PROMPT, turns, obs, sample_id=SID, on_trace_gap="keep_prefix")
    assert (m.num_turns, m.dropped_turns, m.finish_reason) == (1, 1, "length")
    assert m.response_ids.tolist() == [9, 4, 7] and m.loss_mask.tolist() == [1, 1, 1]
    assert np.array_equal(m.routed_experts, position_rows(P + 3 - 1, 1))  # turn 0's own rows
    assert not (m.routed_experts == 0).all(axis=(1, 2)).any()
    assert (m.indexer_topk == 1).all()  # no zero rows replayed, no -1 rows invented


def test_missing_trace_when_enabled():
    # Two concurrent single-turn responses; the second lacks routed_experts while R3 is on.
    first = turn(P, [9, 2], tag=1, finish="stop")
    second = turn(P, [4, 2], tag=2, finish="stop", routed=False)
    ok = merge_turns(PROMPT, [first], [], sample_id=0, require=("routed_experts", "sample_support"))
    assert ok.routed_experts.shape == (P + 2 - 1, L, K)
    with pytest.raises(MissingTraceError) as info:
        merge_turns(PROMPT, [second], [], sample_id=1, require=("routed_experts", "sample_support"))
    assert info.value.sample_id == 1 and info.value.field == "routed_experts"
    assert "sample 1" in str(info.value)


def test_sampled_eos_keeps_its_logprob():
    turns, obs = two_turns()
    turns[1]["rollout_logprobs"] = np.array([-0.75, -4.6], np.float32)  # token 2 = sampled EOS
    m = merge_turns(PROMPT, turns, obs, sample_id=SID)
    assert m.rollout_logprobs[-1] == np.float32(-4.6)
    assert m.sample_support[-1].tolist() == [2, 2, 40, -1]
    s = Sample(sample_id=SID, group_id=0, rollout_id=0, policy_version=0, prompt_ids=PROMPT,
               status="completed", **m.sample_fields())
    assert not s.synthetic_eos
    # Unchanged weights: the proximal logprobs are the behaviour ones, bit for bit.
    logp = torch.from_numpy(np.array(s.rollout_logprobs))
    mask = torch.from_numpy(s.loss_mask.astype(np.int64))
    d = compute_log_ratio(logp.clone(), logp, mask)
    assert sequence_log_weight([d], [mask]).tolist() == [0.0]
    assert sample_gate([d], [mask], 0.999, 1.001, log_weight=sequence_log_weight).tolist() == [True]


def test_merge_errors_name_sample_and_field():
    turns, obs = two_turns()
    cases = [
        (dict(turns=turns, observations=[]), TrajectoryError, "observations"),
        (dict(turns=[], observations=[]), TrajectoryError, "turns"),
        (dict(turns=[turns[0], {**turns[1], "rollout_logprobs": np.array([-1.0])}], observations=obs),
         TrajectoryError, "rollout_logprobs"),
        (dict(turns=[turns[0], {**turns[1], "rollout_logprobs": np.array([-1.0, np.nan])}], observations=obs),
         CaptureError, "rollout_logprobs"),
        (dict(turns=[turns[0], {**turns[1], "routed_experts": turns[1]["routed_experts"][1:]}], observations=obs),
         TrajectoryError, "routed_experts"),
        (dict(turns=[turns[0], {**turns[1], "sample_support": turns[1]["sample_support"][:1]}], observations=obs),
         TrajectoryError, "sample_support"),
        (dict(turns=[{**turns[0], "sample_support": np.array([[9, 9], [5, 5], [7, 7]])}, turns[1]], observations=obs),
         TrajectoryError, "sample_support"),  # column 0 is not the sampled token
        (dict(turns=[{**turns[0], "response_ids": np.array([], int)}, turns[1]], observations=obs),
         TrajectoryError, "response_ids"),
        (dict(turns=[{**turns[0], "finish_reason": None}], observations=[]), TrajectoryError, "finish_reason"),
    ]
    for kwargs, cls, field in cases:
        with pytest.raises(cls) as info:
            merge_turns(PROMPT, sample_id=SID, **kwargs)
        assert info.value.sample_id == SID and info.value.field == field, (field, str(info.value))


def test_a_trace_appearing_only_in_a_later_turn_is_an_error():
    t0 = turn(P, [9, 4, 7], tag=1, indexer=False)
    t1 = turn(P + 3 + 4, [8, 2], tag=2)
    with pytest.raises(TrajectoryError) as info:
        merge_turns(PROMPT, [t0, t1], [[14, 6, 17, 3]], sample_id=SID, on_trace_gap="keep_prefix")
    assert info.value.field == "indexer_topk"


def test_merge_without_traces():
    t0 = turn(P, [9, 4], tag=1, routed=False, indexer=False, support=False)
    t1 = turn(P + 2 + 1, [8], tag=2, routed=False, indexer=False, support=False, finish="stop")
    m = merge_turns(PROMPT, [t0, t1], [[14]], sample_id=SID)
    assert m.response_ids.tolist() == [9, 4, 14, 8] and m.loss_mask.tolist() == [1, 1, 0, 1]
    assert m.sample_support is None and m.routed_experts is None and m.indexer_topk is None
