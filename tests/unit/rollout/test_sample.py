"""The Sample contract (rollout/sample.py) against hand-built trajectories and trace_alignment.json."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from replayrl.rollout.errors import SampleError
from replayrl.rollout.sample import Sample
from tests.paths import CASES

CASES = {c["name"]: c for c in json.loads((CASES / "trace_alignment.json").read_text())}

SID = 42
P, R = 3, 4  # default shape of the hand-built trajectory below
L_MOE, K_ROUTER, L_IDX, K_IDX, W = 2, 2, 1, 3, 2


def fields_of(**overrides):
    """A valid trajectory as plain Python lists (P=3, R=4), with ``overrides`` applied."""
    base = dict(
        sample_id=SID,
        group_id=7,
        rollout_id=3,
        policy_version=5,
        prompt_ids=[1, 13, 17],
        response_ids=[5, 6, 2, 4],
        loss_mask=[1, 1, 1, 0],
        rollout_logprobs=[-0.25, -1.5, -3.0, -0.125],
        reward=0.5,
        status="completed",
    )
    base.update(overrides)
    if isinstance(base["loss_mask"], list):
        # a signed int64 list is not same-kind castable to the uint8 mask; build it as uint8
        base["loss_mask"] = np.array(base["loss_mask"], dtype=np.uint8)
    return base


def rows(n, *inner, fill=0):
    """Nested list with ``n`` rows of shape ``inner`` (distinct values per row, easy to compare)."""
    return (np.arange(n * int(np.prod(inner)), dtype=np.int64).reshape((n, *inner)) + fill).tolist()


def make(**overrides) -> Sample:
    return Sample(**fields_of(**overrides))


def expect_error(field, **overrides) -> SampleError:
    with pytest.raises(SampleError) as info:
        make(**overrides)
    err = info.value
    assert err.sample_id == SID
    assert err.field == field
    assert f"sample {SID}" in str(err)
    assert repr(field) in str(err)
    return err


# ---------------------------------------------------------------- valid construction


def test_valid_construction_converts_dtypes_and_freezes_arrays():
    s = make(
        sample_support=[[5, 5, 6], [6, 6, -1], [2, 2, 5], [-1, -1, -1]],
        routed_experts=rows(P + R - 1, L_MOE, K_ROUTER),
        indexer_topk=rows(P + R - 1, L_IDX, K_IDX, fill=-1),
    )
    expected = {
        "prompt_ids": (np.int32, [1, 13, 17]),
        "response_ids": (np.int32, [5, 6, 2, 4]),
        "loss_mask": (np.uint8, [1, 1, 1, 0]),
        "rollout_logprobs": (np.float32, [-0.25, -1.5, -3.0, -0.125]),  # exact in float32
        "sample_support": (np.int32, [[5, 5, 6], [6, 6, -1], [2, 2, 5], [-1, -1, -1]]),
    }
    for name, (dtype, values) in expected.items():
        arr = getattr(s, name)
        assert arr.dtype == dtype, name
        assert arr.tolist() == values, name
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError):
            arr[0] = 0
    for name, shape in (("routed_experts", (6, L_MOE, K_ROUTER)), ("indexer_topk", (6, L_IDX, K_IDX))):
        arr = getattr(s, name)
        assert arr.dtype == np.int32 and arr.shape == shape and not arr.flags.writeable, name
    assert s.routed_experts[5, 1, 1] == 5 * 4 + 3
    assert s.indexer_topk[0, 0, 0] == -1
    assert type(s.reward) is float and s.reward == 0.5
    assert s.total_length == 7
    assert s.tokens.tolist() == [1, 13, 17, 5, 6, 2, 4]
    assert s.sample_support is not None and s.synthetic_eos is False


def test_bool_loss_mask_and_float64_logprobs_are_converted():
    s = make(loss_mask=np.array([True, True, False, True]),
             rollout_logprobs=np.array([-0.1, -0.2, -0.3, -0.4], dtype=np.float64))
    assert s.loss_mask.dtype == np.uint8 and s.loss_mask.tolist() == [1, 1, 0, 1]
    assert s.rollout_logprobs.dtype == np.float32
    assert s.rollout_logprobs.tolist() == [float(np.float32(v)) for v in (-0.1, -0.2, -0.3, -0.4)]


def test_caller_array_of_the_right_dtype_is_copied_not_shared():
    prompt = np.array([1, 13, 17], dtype=np.int32)
    s = make(prompt_ids=prompt)
    prompt[0] = 99
    assert s.prompt_ids.tolist() == [1, 13, 17]
    assert prompt.flags.writeable  # the caller's array is left as it was


def test_sample_fields_cannot_be_reassigned():
    s = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.reward = 1.0  # type: ignore[misc]


def test_traces_are_optional_and_default_to_none():
    s = make()
    assert s.sample_support is None and s.routed_experts is None and s.indexer_topk is None


# ---------------------------------------------------------------- SampleError cases


@pytest.mark.parametrize("field,value", [
    ("loss_mask", [1, 1, 1]),
    ("loss_mask", [1, 1, 1, 0, 0]),
    ("rollout_logprobs", [-0.5, -0.5, -0.5]),
    ("rollout_logprobs", [-0.5] * 5),
])
def test_per_token_length_mismatch_names_field(field, value):
    err = expect_error(field, **{field: value})
    assert str(len(value)) in str(err) and str(R) in str(err)


@pytest.mark.parametrize("field,n_rows,inner", [
    ("sample_support", R - 1, (1 + W,)),
    ("sample_support", R + 1, (1 + W,)),
    ("sample_support", P + R - 1, (1 + W,)),  # per-position count is wrong for support
    ("routed_experts", P + R, (L_MOE, K_ROUTER)),  # the last token is never forwarded
    ("routed_experts", P + R - 2, (L_MOE, K_ROUTER)),
    ("routed_experts", R, (L_MOE, K_ROUTER)),
    ("indexer_topk", P + R, (L_IDX, K_IDX)),
    ("indexer_topk", P + R - 2, (L_IDX, K_IDX)),
])
def test_trace_row_count_mismatch_names_field(field, n_rows, inner):
    err = expect_error(field, **{field: rows(n_rows, *inner)})
    expected_rows = R if field == "sample_support" else P + R - 1
    assert f"{n_rows} rows, expected {expected_rows}" in str(err)


@pytest.mark.parametrize("field,value", [
    ("prompt_ids", [[1, 13, 17]]),
    ("response_ids", 5),
    ("loss_mask", [[1, 1, 1, 0]]),
    ("rollout_logprobs", [[-0.1, -0.1, -0.1, -0.1]]),
    ("sample_support", [5, 6, 2, 4]),
    ("sample_support", rows(R, 1, 1 + W)),
    ("routed_experts", rows(P + R - 1, L_MOE)),
    ("indexer_topk", rows(P + R - 1, L_IDX, K_IDX, 1)),
])
def test_wrong_rank_names_field(field, value):
    expect_error(field, **{field: value})


@pytest.mark.parametrize("field,value", [
    ("prompt_ids", [1.5, 2.0, 3.0]),
    ("loss_mask", np.array([1.0, 1.0, 1.0, 0.0])),
    ("response_ids", np.array([5.0, 6.0, 2.0, 4.0])),
    ("routed_experts", np.zeros((P + R - 1, L_MOE, K_ROUTER), dtype=np.float32)),
])
def test_float_token_ids_are_rejected_not_truncated(field, value):
    expect_error(field, **{field: value})


@pytest.mark.parametrize("field,value", [
    ("group_id", 1.0), ("rollout_id", True), ("policy_version", "3"), ("policy_version", np.float64(2.0)),
])
def test_an_identity_or_version_field_must_be_an_int(field, value):
    assert "expected an int" in str(expect_error(field, **{field: value}))


def test_a_float_sample_id_is_refused_as_given():
    with pytest.raises(SampleError, match="sample 0.5: field 'sample_id': expected an int, got float"):
        make(sample_id=0.5)


def test_numpy_ints_in_identity_fields_become_python_ints():
    s = make(group_id=np.int64(4), policy_version=np.int32(2))
    assert (s.group_id, s.policy_version) == (4, 2)
    assert type(s.group_id) is int and type(s.policy_version) is int


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("position", [0, 2])
def test_non_finite_logprob_at_loss_bearing_position(bad, position):
    lp = [-0.25, -1.5, -3.0, -0.125]
    lp[position] = bad
    err = expect_error("rollout_logprobs", rollout_logprobs=lp)
    assert f"[{position}]" in str(err)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logprob_allowed_where_loss_mask_is_zero(bad):
    s = make(rollout_logprobs=[-0.25, -1.5, -3.0, bad])  # loss_mask[3] == 0
    assert s.rollout_logprobs[:3].tolist() == [-0.25, -1.5, -3.0]
    assert (math.isnan(s.rollout_logprobs[3]) if math.isnan(bad) else s.rollout_logprobs[3] == bad)


def test_case_nan_in_masked_slot_is_accepted():
    case = CASES["nan_in_masked_slot"]
    s = make(response_ids=[5, 6], loss_mask=case["loss_mask"], rollout_logprobs=case["rollout_logprobs"])
    assert s.loss_mask.tolist() == [1, 0]
    assert s.rollout_logprobs[0] == np.float32(-0.5)
    assert math.isnan(s.rollout_logprobs[1])


def test_loss_mask_values_other_than_0_and_1_are_rejected():
    expect_error("loss_mask", loss_mask=[1, 2, 1, 0])


@pytest.mark.parametrize("status", ["failed", "", "Completed", None])
def test_bad_status(status):
    err = expect_error("status", status=status)
    assert repr(status) in str(err)


@pytest.mark.parametrize("status", ["completed", "truncated", "aborted"])
def test_every_known_status_is_accepted(status):
    assert make(status=status).status == status


@pytest.mark.parametrize("reward", [math.nan, math.inf])
def test_non_finite_reward(reward):
    expect_error("reward", reward=reward)


def test_empty_prompt():
    err = expect_error("prompt_ids", prompt_ids=[])
    assert "empty" in str(err)


def test_empty_response_is_allowed_without_traces_that_need_rows():
    s = make(response_ids=[], loss_mask=[], rollout_logprobs=[], routed_experts=rows(P - 1, L_MOE, K_ROUTER))
    assert s.total_length == P and s.routed_experts.shape == (P - 1, L_MOE, K_ROUTER)


def test_synthetic_eos_on_empty_response():
    expect_error("synthetic_eos", response_ids=[], loss_mask=[], rollout_logprobs=[], synthetic_eos=True)


def test_synthetic_eos_row_with_a_candidate_is_rejected():
    support = [[5, 5, 6], [6, 6, -1], [2, 2, 5], [4, -1, 4]]  # last row lists a candidate
    expect_error("sample_support", sample_support=support, synthetic_eos=True)


def test_same_support_without_synthetic_eos_is_accepted():
    support = [[5, 5, 6], [6, 6, -1], [2, 2, 5], [4, -1, 4]]
    assert make(sample_support=support).sample_support[-1].tolist() == [4, -1, 4]


# ---------------------------------------------------------------- to_dict / from_dict


def full_sample(**overrides) -> Sample:
    return make(
        reward=0.75,
        status="truncated",
        sample_support=[[5, 5, 6], [6, 6, -1], [2, 2, 5], [4, -1, -1]],
        routed_experts=rows(P + R - 1, L_MOE, K_ROUTER),
        indexer_topk=rows(P + R - 1, L_IDX, K_IDX, fill=-1),
        synthetic_eos=True,
        **overrides,
    )


def test_to_dict_has_every_field_and_from_dict_round_trips():
    s = full_sample()
    d = s.to_dict()
    assert set(d) == {
        "sample_id", "group_id", "rollout_id", "policy_version", "prompt_ids", "response_ids",
        "loss_mask", "rollout_logprobs", "reward", "status", "sample_support", "routed_experts",
        "indexer_topk", "synthetic_eos",
    }
    back = Sample.from_dict(d)
    assert (back.sample_id, back.group_id, back.rollout_id, back.policy_version) == (SID, 7, 3, 5)
    assert (back.reward, back.status, back.synthetic_eos) == (0.75, "truncated", True)
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "sample_support",
                 "routed_experts", "indexer_topk"):
        a, b = getattr(s, name), getattr(back, name)
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert np.array_equal(a, b), name
        assert not b.flags.writeable, name


def test_from_dict_of_plain_lists_matches_the_sample():
    # a decoded message may carry lists instead of arrays
    plain = {k: (v.tolist() if isinstance(v, np.ndarray) and k != "loss_mask" else v)
             for k, v in full_sample().to_dict().items()}
    back = Sample.from_dict(plain)
    assert back.routed_experts.dtype == np.int32
    assert back.rollout_logprobs.tolist() == [-0.25, -1.5, -3.0, -0.125]


def test_from_dict_without_optional_fields_uses_defaults():
    d = {k: v for k, v in make().to_dict().items()
         if k not in ("reward", "status", "sample_support", "routed_experts", "indexer_topk", "synthetic_eos")}
    back = Sample.from_dict(d)
    assert (back.reward, back.status, back.synthetic_eos, back.sample_support) == (0.0, "completed", False, None)


def test_from_dict_rejects_unknown_field():
    d = make().to_dict()
    d["advantage"] = 1.0
    with pytest.raises(SampleError) as info:
        Sample.from_dict(d)
    assert info.value.field == "advantage" and info.value.sample_id == SID
    assert f"sample {SID}" in str(info.value) and "unknown" in str(info.value)


@pytest.mark.parametrize("missing", ["sample_id", "group_id", "rollout_id", "policy_version",
                                     "prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"])
def test_from_dict_rejects_missing_required_field(missing):
    d = make().to_dict()
    del d[missing]
    with pytest.raises(SampleError) as info:
        Sample.from_dict(d)
    assert info.value.field == missing
    assert "missing" in str(info.value)
    assert info.value.sample_id == ("?" if missing == "sample_id" else SID)


def test_from_dict_rejects_a_non_mapping():
    with pytest.raises(SampleError):
        Sample.from_dict([("sample_id", 1)])


# ---------------------------------------------------------------- trace_alignment.json at the Sample level


def test_case_truncated_then_synthetic_eos():
    case = CASES["truncated_then_synthetic_eos"]
    k = case["top_k"]
    resp = case["response_ids"]
    # four sampled rows with their captured support, then the appended EOS without candidates
    support = [[t, t] + [-1] * (k - 1) for t in resp[:-1]] + [case["expected_last_row"]]
    s = make(response_ids=resp, loss_mask=case["loss_mask"], rollout_logprobs=[-0.5] * len(resp),
             sample_support=support, synthetic_eos=case["synthetic_eos"], status="truncated")
    assert s.sample_support.shape == (case["expected_support_rows"], 1 + k)
    assert s.sample_support[-1].tolist() == [2, -1, -1, -1]
    assert s.synthetic_eos is True
    assert s.loss_mask[-1] == 1


def test_case_multi_turn_observation_rows():
    case = CASES["multi_turn_observation_rows"]
    mask = case["loss_mask"]
    n = len(mask)
    resp = [3 + i for i in range(n)]
    support = [[t, t, -1] if m else [-1, -1, -1] for t, m in zip(resp, mask)]
    lp = [-0.5 if m else math.nan for m in mask]  # observation tokens were never sampled
    s = make(response_ids=resp, loss_mask=mask, rollout_logprobs=lp, sample_support=support,
             routed_experts=rows(P + n - 1, L_MOE, K_ROUTER))
    assert s.sample_support.shape[0] == case["expected_support_rows"] == 9
    obs = np.flatnonzero(s.loss_mask == 0)
    assert obs.tolist() == [3, 4, 5, 6]
    assert case["expected_observation_rows_all_minus_one"]
    assert (s.sample_support[obs] == -1).all()
    assert s.routed_experts.shape[0] == P + 9 - 1


def test_case_sampled_eos_keeps_its_logprob():
    lp = [-0.25, -1.5, -3.0, -4.6]
    s = make(response_ids=[5, 6, 7, 2], loss_mask=[1, 1, 1, 1], rollout_logprobs=lp,
             sample_support=[[5, 5, 6], [6, 6, 5], [7, 7, 5], [2, 2, 5]])
    back = Sample.from_dict(s.to_dict())
    assert back.rollout_logprobs.dtype == np.float32
    assert back.rollout_logprobs[-1] == np.float32(-4.6)
    assert back.rollout_logprobs[-1].tobytes() == np.array([-4.6], dtype=np.float32).tobytes()
    assert back.sample_support[-1].tolist() == [2, 2, 5]  # its own support row, not a fallback
    assert back.synthetic_eos is False


def test_case_two_unsupported_rows_is_rejected():
    # rows 1 and 3 are loss-bearing with a sampled id but no candidates
    support = [[5, 5, 6], [6, -1, -1], [2, 2, 5], [4, -1, -1]]
    expect_error("sample_support", loss_mask=[1, 1, 1, 1], sample_support=support, synthetic_eos=True)
