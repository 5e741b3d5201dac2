"""Exact-refill planner against tests/cases/refill_planner.json and refill_admission.json."""

from __future__ import annotations

import json

import pytest

from replayrl.trainer.errors import RefillConfigError, RefillExhausted
from replayrl.trainer.rejection.refill_planner import (
    RefillRequest,
    plan_refill_rounds,
    refill_quantum,
    replacement_target,
)
from replayrl.trainer.rejection.rs_gates import group_admission
from tests.paths import CASES

CASES = CASES
PLANNER = json.loads((CASES / "refill_planner.json").read_text())
ADMISSION = json.loads((CASES / "refill_admission.json").read_text())


def _quantum(cfg):
    return refill_quantum(cfg["dp_size"], cfg["n_samples_per_prompt"], cfg["vpp_size"],
                          cfg.get("microbatch_group_size", 1))


@pytest.mark.parametrize("case", PLANNER, ids=lambda c: c["name"])
def test_planner_cases(case):
    q = _quantum(case["config"])
    for c in case["cases"]:
        assert replacement_target(c["deficit"], q) == c["expected_target"], c
    if "expected_mean_target_over_deficits_1_to_64" in case:
        mean = sum(replacement_target(d, q) for d in range(1, 65)) / 64
        assert mean == case["expected_mean_target_over_deficits_1_to_64"]


def test_quantum_by_hand():
    # A = 8 * 4 = 32 samples, n = 8: gcd 8, q = 4 groups = 32 samples.
    assert refill_quantum(8, 8, 2, 4) == 4
    # Without VPP the microbatch group size is ignored: A = 8, q = 1.
    assert refill_quantum(8, 8, 1, 4) == 1
    # A = 6, n = 4: q = 3 groups = 12 samples, the lcm of 6 and 4.
    assert refill_quantum(6, 4, 1, 1) == 3


@pytest.mark.parametrize("args", [(0, 8, 1, 1), (8, 0, 1, 1), (8, 8, 0, 1), (8, 8, 2, 0), (8.0, 8, 1, 1)])
def test_quantum_rejects_bad_sizes(args):
    with pytest.raises(RefillConfigError):
        refill_quantum(*args)


def test_replacement_target_rejects_bad_input():
    with pytest.raises(RefillConfigError, match="deficit"):
        replacement_target(-1, 4)
    with pytest.raises(RefillConfigError, match="quantum"):
        replacement_target(3, 0)


def _initial_plan():
    cfg = ADMISSION["config"]
    samples = ADMISSION["initial_groups"]
    accept = [ok for g in samples for ok in samples[g]]
    ids = [g for g in samples for _ in samples[g]]
    admission = group_admission(accept, ids, n_samples_per_prompt=cfg["n_samples_per_prompt"])
    return plan_refill_rounds(
        admission,
        target_groups=cfg["rollout_batch_size"],
        quantum=refill_quantum(cfg["dp_size"], cfg["n_samples_per_prompt"], cfg["vpp_size"], 1),
        max_rounds=cfg["max_rounds"],
    )


def test_admission_case_drops_b_and_requests_one_replacement():
    plan = _initial_plan()
    want = ADMISSION["expected"]
    assert list(plan.admitted) == want["admitted"]
    assert list(plan.rejected) == want["rejected"]
    assert plan.request == RefillRequest(round=1, n_groups=want["replacement_groups_requested"])
    # "if it passes the step trains on 2 whole groups"
    done = plan.record({"R1": True})
    assert done.done and done.request is None and done.admitted == ("A", "R1")


def test_admission_case_exhaustion_raises_after_max_rounds():
    plan = _initial_plan()
    rounds = ADMISSION["exhaustion"]["replacement_rounds"]
    assert len(rounds) == ADMISSION["config"]["max_rounds"]
    for i, results in enumerate(rounds[:-1]):
        plan = plan.record({f"R{i + 1}": ok for ok in results})
        assert plan.request == RefillRequest(round=i + 2, n_groups=1)
    with pytest.raises(RefillExhausted) as info:
        plan.record({f"R{len(rounds)}": ok for ok in rounds[-1]})
    assert info.value.admitted == ("A",) and info.value.rounds == 2


def test_quantum_overshoot_keeps_request_order_and_drops_surplus():
    # 8 groups, q = 4: two rejected -> request 4; three pass -> the first two in request
    # order fill the deficit, the third is surplus.
    initial = {f"g{i}": i not in (2, 5) for i in range(8)}
    plan = plan_refill_rounds(initial, target_groups=8, quantum=4, max_rounds=1)
    assert plan.deficit == 2 and plan.request == RefillRequest(1, 4)
    plan = plan.record({"r0": False, "r1": True, "r2": True, "r3": True})
    assert plan.done
    assert plan.admitted[-2:] == ("r1", "r2") and plan.surplus == ("r3",)
    assert plan.rejected == ("g2", "g5", "r0")


def test_partial_round_requests_the_remaining_deficit_rounded_up():
    plan = plan_refill_rounds({i: i >= 3 for i in range(8)}, target_groups=8, quantum=2, max_rounds=3)
    assert plan.request == RefillRequest(1, 4)  # deficit 3 -> 4
    plan = plan.record({"a": True, "b": False, "c": False, "d": False})
    assert plan.request == RefillRequest(2, 2)  # deficit 2 -> 2
    plan = plan.record({"e": True, "f": True})
    assert plan.done and plan.rounds == 2


def test_no_deficit_needs_no_round_and_max_rounds_zero_raises_at_once():
    plan = plan_refill_rounds({"A": True, "B": True}, target_groups=2, quantum=1, max_rounds=0)
    assert plan.done and plan.request is None
    with pytest.raises(RefillConfigError, match="done"):
        plan.record({"C": True})
    with pytest.raises(RefillExhausted):
        plan_refill_rounds({"A": True, "B": False}, target_groups=2, quantum=1, max_rounds=0)


def test_bad_rounds_raise():
    plan = plan_refill_rounds({"A": True, "B": False}, target_groups=2, quantum=1, max_rounds=2)
    with pytest.raises(RefillConfigError, match="requested 1"):
        plan.record({"C": True, "D": True})
    with pytest.raises(RefillConfigError, match="already"):
        plan.record({"B": True})
    with pytest.raises(RefillConfigError, match="bool"):
        plan.record({"C": 1})
    with pytest.raises(RefillConfigError, match="initial round"):
        plan_refill_rounds({"A": True}, target_groups=2, quantum=1, max_rounds=2)
