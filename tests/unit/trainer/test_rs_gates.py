"""RS gates against tests/cases/rs_gates.json and hand computations."""

from __future__ import annotations

import json
import math

import pytest
import torch

from replayrl.trainer.errors import RSBoundsError, RSError
from replayrl.trainer.rejection.rs_gates import (
    SAMPLE_LOG_WEIGHTS,
    compute_log_ratio,
    geometric_log_weight,
    group_admission,
    sample_gate,
    sequence_log_weight,
    token_gate,
)
from tests.paths import CASES

CASES = json.loads((CASES / "rs_gates.json").read_text())


def test_token_level_case():
    case = CASES["token_level"]
    d = torch.tensor(case["log_ratio"])
    got = token_gate(d, torch.ones(len(d), dtype=torch.uint8), case["lower"], case["upper"])
    assert got.tolist() == case["expected_accept"]


def test_token_gate_accepts_masked_tokens_even_if_nan():
    d = torch.tensor([5.0, float("nan"), float("-inf"), 0.0])
    got = token_gate(d, torch.tensor([1, 0, 0, 1]), 0.5, 2.0)
    assert got.tolist() == [False, True, True, True]


def _packed(samples):
    d = torch.cat([torch.tensor(s["log_ratio"], dtype=torch.float32) for s in samples])
    m = torch.cat([torch.tensor(s["loss_mask"]) for s in samples])
    cu = [0]
    for s in samples:
        cu.append(cu[-1] + len(s["log_ratio"]))
    return d, m, torch.tensor(cu)


@pytest.mark.parametrize("layout", ["packed", "per_sample"])
def test_sequence_and_geometric_case(layout):
    case = CASES["sequence_and_geometric"]
    samples = case["samples"]
    if layout == "packed":
        d, m, cu = _packed(samples)
        args, kw = (d, m), {"cu_seqlens": cu}
    else:
        args = ([torch.tensor(s["log_ratio"]) for s in samples], [torch.tensor(s["loss_mask"]) for s in samples])
        kw = {}
    seq = sequence_log_weight(*args, **kw)
    geo = geometric_log_weight(*args, **kw)
    assert seq.dtype == torch.float64
    for i, s in enumerate(samples):
        assert seq[i].item() == pytest.approx(s["expected_sequence_log_weight"], abs=1e-6), s["id"]
        assert geo[i].item() == pytest.approx(s["expected_geometric_log_weight"], abs=1e-6), s["id"]
    seq_accept = sample_gate(*args, *case["sequence_bounds"], log_weight=sequence_log_weight, **kw)
    geo_accept = sample_gate(*args, *case["geometric_bounds"], log_weight=geometric_log_weight, **kw)
    assert seq_accept.tolist() == case["expected_sequence_accept"]
    assert geo_accept.tolist() == case["expected_geometric_accept"]
    # the run's modes name the same two weight functions
    assert SAMPLE_LOG_WEIGHTS["sequence"] is sequence_log_weight
    assert SAMPLE_LOG_WEIGHTS["geometric"] is geometric_log_weight


def test_masked_nan_does_not_reach_sequence_weight():
    d = torch.tensor([0.2, float("nan"), 0.1, float("inf")])
    m = torch.tensor([1, 0, 1, 0])
    w = sequence_log_weight(d, m, cu_seqlens=[0, 2, 4])
    assert w.tolist() == pytest.approx([0.2, 0.1], abs=1e-7)
    assert sample_gate(d, m, 0.9, 1.3, log_weight=geometric_log_weight,
                       cu_seqlens=[0, 2, 4]).tolist() == [True, True]


def test_compute_log_ratio_zeroes_masked_and_is_detached():
    prox = torch.tensor([-0.5, -1.0, -2.0], requires_grad=True)
    roll = torch.tensor([-0.7, float("nan"), -1.5])
    d = compute_log_ratio(prox, roll, torch.tensor([True, False, True]))
    assert d.tolist() == pytest.approx([0.2, 0.0, -0.5], abs=1e-6) and not d.requires_grad


def test_unchanged_weights_give_weight_one_and_accept():
    lp = torch.tensor([-0.1, -2.3, -4.6])
    d = compute_log_ratio(lp, lp.clone(), torch.ones(3))
    assert sequence_log_weight(d, torch.ones(3), cu_seqlens=[0, 3]).item() == 0.0
    assert sample_gate(d, torch.ones(3), 0.999, 1.001, log_weight=sequence_log_weight,
                       cu_seqlens=[0, 3]).tolist() == [True]


def test_bounds_are_inclusive():
    d = torch.tensor([math.log(0.5), math.log(2.0)], dtype=torch.float64)
    assert token_gate(d, torch.ones(2), 0.5, 2.0).tolist() == [True, True]


@pytest.mark.parametrize("lower, upper", [(2.0, 0.5), (0.0, 2.0), (-1.0, 2.0), (0.5, -2.0), (float("nan"), 2.0)])
def test_bad_bounds_raise(lower, upper):
    with pytest.raises(RSBoundsError):
        token_gate(torch.zeros(1), torch.ones(1), lower, upper)
    for log_weight in (sequence_log_weight, geometric_log_weight):
        with pytest.raises(RSBoundsError):
            sample_gate(torch.zeros(1), torch.ones(1), lower, upper, log_weight=log_weight,
                        cu_seqlens=[0, 1])


def test_infinite_upper_bound_is_allowed():
    assert token_gate(torch.tensor([50.0]), torch.ones(1), 0.5, float("inf")).tolist() == [True]


def test_bad_inputs_raise():
    with pytest.raises(RSError, match=r"samples \[1\]"):
        sequence_log_weight(torch.tensor([0.0, float("nan")]), torch.ones(2), cu_seqlens=[0, 1, 2])
    with pytest.raises(RSError, match="cu_seqlens"):
        sequence_log_weight(torch.zeros(3), torch.ones(3), cu_seqlens=[0, 2])
    with pytest.raises(RSError, match="cu_seqlens"):
        sequence_log_weight(torch.zeros(3), torch.ones(3))
    with pytest.raises(RSError, match="0/1"):
        token_gate(torch.zeros(2), torch.tensor([1, 2]), 0.5, 2.0)
    with pytest.raises(RSError, match="sample 1"):
        geometric_log_weight([torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.ones(2)])


def test_group_admission_is_group_atomic():
    # refill_admission.json initial groups: A passes whole, B has one failing sample.
    got = group_admission([True, True, True, False], ["A", "A", "B", "B"], n_samples_per_prompt=2)
    assert got == {"A": True, "B": False}
    assert group_admission(torch.tensor([False, True]), [7, 7]) == {7: False}


def test_group_admission_errors():
    with pytest.raises(RSError, match="group"):
        group_admission([True, True, True], ["A", "A", "B"], n_samples_per_prompt=2)
    with pytest.raises(RSError):
        group_admission([True], ["A", "B"])
    with pytest.raises(RSError, match="bool"):
        group_admission([1, 0], ["A", "A"])
