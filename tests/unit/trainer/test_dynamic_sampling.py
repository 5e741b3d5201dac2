"""Dynamic sampling (--dynamic-sampling): which groups drop, how many replacements are requested
(the refill quantum), the fail-closed round limit, RS refill in the same step, and the settings
refused before start.

The coordinator runs against fake manager / clock proxies (tests/fakes.py) with canned
replacement rounds; every expected count below is worked out by hand from the rewards and the
quantum formula ``q = A / gcd(A, n)``, ``request = ceil(deficit / q) * q``
(docs/design/rejection-sampling.md#exact-refill).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.actors.errors import StaleSample
from replayrl.actors.version_clock import VersionRules
from replayrl.rollout.sample import Sample, samples_to_columns
from replayrl.tools.run.config import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import RefillConfigError, RefillExhausted, TrainerConfigError
from replayrl.trainer.ranks.proximal_cache import ProximalLogprobCache
from replayrl.trainer.ranks.trainer_actor import _no_preflight
from replayrl.trainer.rejection.dynamic_sampling import combine_admission, informative_groups
from replayrl.trainer.rejection.refill import RefillCoordinator
from tests.fakes import FakeProxy

VERSION = 5


def _sample(sample_id: int, group_id: int, reward: float, rs_ok: bool = True,
            version: int = VERSION) -> Sample:
    # logp_prox is 0 (the fake preflight); rollout logprob -1 at both tokens gives
    # exp(sum d) = e^2 > 2, outside a sequence band [0.5, 2] (rejected); 0 gives exactly 1
    return Sample(sample_id=sample_id, group_id=group_id, rollout_id=0, policy_version=version,
                  prompt_ids=np.array([1, 3], np.int32), response_ids=np.array([5, 6], np.int32),
                  loss_mask=np.array([1, 1], np.uint8),
                  rollout_logprobs=np.array([0.0 if rs_ok else -1.0] * 2, np.float32),
                  reward=reward)


def _groups(spec: list[tuple[list[float], bool]], first_group: int) -> list[Sample]:
    """Samples of prompt groups ``(rewards, rs_ok)``, group ids from ``first_group``."""
    out = []
    for g, (rewards, ok) in enumerate(spec, start=first_group):
        out += [_sample(g * 100 + i, g, r, ok) for i, r in enumerate(rewards)]
    return out


class Fakes:
    """The cache, preflight, manager and clock a coordinator is given; replacements are the
    canned ``rounds`` (one list of ``(rewards, rs_ok)`` groups per request)."""

    def __init__(self, rounds: list[list[tuple[list[float], bool]]], version: int = VERSION,
                 replacement_version: int = VERSION) -> None:
        self.cache, self.rules = ProximalLogprobCache(), VersionRules()
        self.requested: list[int] = []
        self.preflighted: list[int] = []

        async def generate_replacements(n_groups, min_version):
            assert min_version == version
            self.requested.append(n_groups)
            spec = rounds[len(self.requested) - 1]
            assert len(spec) == n_groups, "the test's canned round must match the request"
            out = _groups(spec, first_group=1000 * len(self.requested))
            return samples_to_columns([_sample(s.sample_id, s.group_id, s.reward,
                                               bool(s.rollout_logprobs[0] == 0.0),
                                               replacement_version) for s in out])

        async def check_replacements(preflight_version, ids, versions):
            bad = [s for s, v in zip(ids, versions) if not self.rules.replacement_ok(preflight_version, v)]
            if bad:
                raise StaleSample(f"replacement samples not at preflight version: {bad}")

        self.manager = FakeProxy(generate_replacements=generate_replacements)
        self.clock = FakeProxy(check_replacements=check_replacements)

    async def preflight(self, samples):
        self.preflighted += [s.sample_id for s in samples]
        for s in samples:
            self.cache.put(s.sample_id, torch.zeros(len(s.response_ids)))
        return {}


def _coordinator(fakes: Fakes, cfg: TrainerConfig, target: int, n: int = 2) -> RefillCoordinator:
    # without an RS gate the trainer gives the coordinator its no-op preflight (fused update)
    preflight = fakes.preflight if cfg.rs_gate.active else _no_preflight
    return RefillCoordinator(cfg.rs_gate, cfg, target, n, cache=fakes.cache,
                             preflight=preflight, manager=fakes.manager, clock=fakes.clock,
                             version=VERSION)


# ---- the pure decision ----------------------------------------------------------------------


def test_informative_groups_by_hand():
    # groups need not be contiguous; a 0/1 group is informative iff 0 < #correct < n
    rewards = [1.0, 0.0, 1.0, 1.0, 0.25, 0.25, 0.5, 0.5 + 2 ** -20]
    ids = ["a", "a", "b", "c", "b", "c", "d", "d"]
    # a: {1, 0} differ; b: {1, 0.25} differ; c: {1, 0.25} differ; d: differ in the 20th bit
    assert informative_groups(rewards, ids, n_samples_per_prompt=2) == {
        "a": True, "b": True, "c": True, "d": True}
    got = informative_groups([1.0, 1.0, 0.0, 0.0, 0.3, 0.7], [0, 0, 1, 1, 2, 2],
                             n_samples_per_prompt=2)
    assert got == {0: False, 1: False, 2: True}
    assert list(got) == [0, 1, 2]  # order of first appearance
    assert informative_groups([0.5] * 4, [3] * 4, n_samples_per_prompt=4) == {3: False}


def test_informative_groups_refuses_bad_input():
    with pytest.raises(RefillConfigError, match="n_samples_per_prompt >= 2"):
        informative_groups([1.0], [0], n_samples_per_prompt=1)
    with pytest.raises(RefillConfigError, match="3 rewards for 2 group ids"):
        informative_groups([1.0, 0.0, 1.0], [0, 0], n_samples_per_prompt=2)
    with pytest.raises(RefillConfigError, match=r"sample 1 \(group 7\): reward must be a finite"):
        informative_groups([1.0, float("nan")], [7, 7], n_samples_per_prompt=2)
    with pytest.raises(RefillConfigError, match=r"\{9: 1\}"):
        informative_groups([1.0, 0.0, 1.0], [4, 4, 9], n_samples_per_prompt=2)


def test_combine_admission_needs_both():
    gate = {"a": True, "b": False, "c": True, "d": False}
    informative = {"a": True, "b": True, "c": False, "d": False}
    assert combine_admission(gate, informative) == {"a": True, "b": False, "c": False, "d": False}
    with pytest.raises(RefillConfigError, match="disagree on the groups"):
        combine_admission({"a": True}, {"b": True})


# ---- the coordinator: drops, requests, rounds ------------------------------------------------


async def test_zero_variance_groups_drop_and_refill_in_quanta():
    # --dp-size 4, n 2: A = 4, q = 4 / gcd(4, 2) = 2 groups per request
    cfg = TrainerConfig(dynamic_sampling=True, dp_size=4, rs_refill_max_rounds=3)
    initial = _groups([([1.0, 0.0], True), ([1.0, 1.0], True), ([0.0, 0.0], True),
                       ([0.5, 0.25], True)], first_group=0)
    # deficit 2 -> request ceil(2/2)*2 = 2: one zero-variance, one informative
    # deficit 1 -> request ceil(1/2)*2 = 2: both informative, the second is surplus
    fakes = Fakes([[([1.0, 1.0], True), ([0.0, 1.0], True)],
                   [([1.0, 0.0], True), ([0.0, 1.0], True)]])
    admitted, token_accept, m = await _coordinator(fakes, cfg, target=4).admit(initial)
    assert fakes.requested == [2, 2]
    # replacement group i of round r has id 1000 r + i
    assert [g for g in dict.fromkeys(s.group_id for s in admitted)] == [0, 3, 1001, 2000]
    assert len(admitted) == 8 and all(bool(t.all()) for t in token_accept.values())
    assert (m["refill_rounds"], m["admitted_groups"], m["rejected_groups"],
            m["surplus_groups"], m["zero_variance_groups"]) == (2, 4, 3, 1, 3)
    assert [r["zero_variance_groups"] for r in m["refill_round_detail"]] == [2, 1, 0]
    assert [r["candidate_groups"] for r in m["refill_round_detail"]] == [4, 2, 2]
    # every trained group has rewards that differ
    for g in {s.group_id for s in admitted}:
        assert len({s.reward for s in admitted if s.group_id == g}) == 2
    # without an RS gate nothing needs a proximal logprob: the cache stays empty
    assert fakes.cache.entries == {}


async def test_dynamic_sampling_fails_closed_after_the_round_limit():
    cfg = TrainerConfig(dynamic_sampling=True, rs_refill_max_rounds=2)
    initial = _groups([([1.0, 0.0], True), ([1.0, 1.0], True)], first_group=0)
    fakes = Fakes([[([0.0, 0.0], True)], [([1.0, 1.0], True)]])
    with pytest.raises(RefillExhausted, match="1 of 2 prompt groups admitted after 2"):
        await _coordinator(fakes, cfg, target=2).admit(initial)
    assert fakes.requested == [1, 1]


async def test_replacements_from_another_version_are_refused():
    cfg = TrainerConfig(dynamic_sampling=True)
    initial = _groups([([1.0, 0.0], True), ([1.0, 1.0], True)], first_group=0)
    fakes = Fakes([[([0.0, 1.0], True)]], replacement_version=VERSION - 1)
    with pytest.raises(StaleSample, match="preflight version"):
        await _coordinator(fakes, cfg, target=2).admit(initial)


async def test_rs_refill_and_dynamic_sampling_share_one_path():
    cfg = TrainerConfig(dynamic_sampling=True, rs_mode="sequence", rs_lower=0.5, rs_upper=2.0,
                        rs_batch_refill=True, rs_refill_max_rounds=2)
    # g0 passes both; g1 RS-rejected; g2 zero variance; g3 both.  n 2, dp 1: q = 1
    initial = _groups([([1.0, 0.0], True), ([1.0, 0.0], False), ([1.0, 1.0], True),
                       ([0.0, 0.0], False)], first_group=0)
    fakes = Fakes([[([0.0, 1.0], True), ([1.0, 0.0], False), ([0.5, 0.5], True)],
                   [([1.0, 0.0], True), ([0.0, 1.0], True)]])
    await fakes.preflight(initial)
    admitted, _, m = await _coordinator(fakes, cfg, target=4).admit(initial)
    # round 0: 3 dropped -> request 3; round 1: 1 admitted, 2 dropped -> request 2; round 2: 2
    assert fakes.requested == [3, 2]
    assert [g for g in dict.fromkeys(s.group_id for s in admitted)] == [0, 1000, 2000, 2001]
    assert (m["rejected_groups"], m["zero_variance_groups"], m["refill_rounds"]) == (5, 3, 2)
    assert [r["rejected_groups"] for r in m["refill_round_detail"]] == [3, 2, 0]
    # the replacements had their own preflight; only admitted entries stay cached
    assert len(fakes.preflighted) == 2 * (4 + 3 + 2)
    fakes.cache.check_bijection([s.sample_id for s in admitted])


async def test_off_adds_no_key():
    cfg = TrainerConfig(rs_mode="sequence", rs_lower=0.5, rs_upper=2.0, rs_batch_refill=True)
    initial = _groups([([1.0, 1.0], True), ([0.0, 0.0], True)], first_group=0)
    fakes = Fakes([])
    await fakes.preflight(initial)
    admitted, _, m = await _coordinator(fakes, cfg, target=2).admit(initial)
    assert len(admitted) == 4 and fakes.requested == []  # equal rewards are no reason to drop
    assert "zero_variance_groups" not in m
    assert all("zero_variance_groups" not in r for r in m["refill_round_detail"])


# ---- settings refused before start -----------------------------------------------------------


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match="--n-samples-per-prompt must be >= 2"):
        build_config({"dynamic-sampling": True, "n-samples-per-prompt": 1, "progress": False})
    with pytest.raises(TrainerConfigError, match="--dynamic-sampling with --rs-mode"):
        TrainerConfig(dynamic_sampling=True, rs_mode="token", rs_lower=0.5, rs_upper=2.0)
    assert build_config({"dynamic-sampling": True, "progress": False}).trainer.dynamic_sampling
