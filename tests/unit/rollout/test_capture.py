"""Capture normalisation for external engines (rollout/traces/capture.py) against trace_alignment.json."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from replayrl.rollout.errors import CaptureError
from replayrl.rollout.traces.capture import check_route_offset, check_sampled_logprob, normalize_support_row
from tests.paths import CASES

CASES = {c["name"]: c for c in json.loads((CASES / "trace_alignment.json").read_text())}
NEG_INF = float("-inf")


def test_capture_repair_sampled_not_in_topk():
    case = CASES["capture_repair_sampled_not_in_topk"]
    logits = np.array(case["logits"], dtype=np.float64)
    # log-softmax by hand: log(e^3 + 3 e^1) normalises all four logits
    log_norm = math.log(math.exp(3.0) + 3 * math.exp(1.0))
    recorded = case["recorded"]
    logprobs = [logits[i] - log_norm for i in recorded]
    row = normalize_support_row(recorded, logprobs, case["sampled"], case["top_k"])
    assert row.tolist() == case["expected_row"] == [3, 0, 3]
    assert row.dtype == np.int32 and not row.flags.writeable


def test_sampled_present_keeps_the_row_and_minus_inf_becomes_minus_one():
    row = normalize_support_row([4, 7, 9], [-0.1, -2.4, NEG_INF], 7, 4)
    assert row.tolist() == [7, 4, 7, -1, -1]


def test_repair_overwrites_the_weakest_valid_candidate_not_an_excluded_slot():
    row = normalize_support_row([4, 7, 9], [-0.1, -2.4, NEG_INF], 5, 3)
    assert row.tolist() == [5, 4, 5, -1]


def test_repair_among_equal_weakest_takes_the_later_column():
    row = normalize_support_row([4, 7, 9], [-0.5, -1.5, -1.5], 2, 3)
    assert row.tolist() == [2, 4, 7, 2]


@pytest.mark.parametrize("ids, logprobs, sampled, top_k, problem", [
    ([1, 2, 3], [-1.0, -2.0, -3.0], 1, 2, "refusing to drop"),
    ([1, 2], [-1.0], 1, 2, "equal length"),
    ([1, 2], [-1.0, float("nan")], 1, 2, "finite"),
    ([1, 2], [-1.0, float("inf")], 1, 2, "finite"),
    ([1, 1], [-1.0, -2.0], 1, 2, "repeated"),
    ([1, 2], [-1.0, NEG_INF], 2, 2, "-inf"),
    ([1, 2], [NEG_INF, NEG_INF], 3, 2, "no valid candidate"),
    ([-1, 2], [-1.0, -2.0], 2, 2, "negative"),
    ([1], [-1.0], 1, 0, "top_k"),
    ([1], [-1.0], -1, 1, "sampled id"),
])
def test_malformed_capture_is_rejected(ids, logprobs, sampled, top_k, problem):
    with pytest.raises(CaptureError) as info:
        normalize_support_row(ids, logprobs, sampled, top_k, sample_id=9, index=4)
    err = info.value
    assert err.sample_id == 9 and err.field == "sample_support"
    assert problem in str(err) and "response index 4" in str(err)


def test_check_sampled_logprob_passes_finite_values():
    assert check_sampled_logprob(np.float32(-4.5), 3, 0) == -4.5
    assert check_sampled_logprob(0.0, 3, 0) == 0.0


@pytest.mark.parametrize("value", [float("nan"), float("inf"), NEG_INF, "x", None])
def test_check_sampled_logprob_never_clamps(value):
    with pytest.raises(CaptureError) as info:
        check_sampled_logprob(value, 3, 5)
    assert info.value.sample_id == 3 and info.value.field == "rollout_logprobs"
    assert "response index 5" in str(info.value)


def test_route_offset_bounds():
    case = CASES["route_offset_bounds"]
    P = case["prompt_len"]
    for start in case["valid_starts"]:
        assert check_route_offset(start, P, sample_id=2) == start
    for start in case["invalid_starts"]:
        with pytest.raises(CaptureError) as info:
            check_route_offset(start, P, sample_id=2)
        assert info.value.sample_id == 2 and info.value.field == "route_start"


@pytest.mark.parametrize("start, prompt_len", [(1.0, 4), (True, 4), (0, 2.0)])
def test_route_offset_needs_ints(start, prompt_len):
    with pytest.raises(CaptureError):
        check_route_offset(start, prompt_len)
