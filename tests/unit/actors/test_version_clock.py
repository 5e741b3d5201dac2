"""VersionClock rules against tests/cases/staleness.json, plus checkpoint round trip."""
from __future__ import annotations

import json

import pytest

from replayrl.actors.errors import StaleSample, VersionError, VersionRegression
from replayrl.actors.version_clock import VersionClock, VersionRules
from tests.paths import CASES

CASES = json.loads((CASES / "staleness.json").read_text())


@pytest.mark.parametrize("case", CASES["cases"], ids=lambda c: f"t{c['trainer_version']}-v{c['sample_version']}")
def test_staleness_window(case):
    rules = VersionRules(max_staleness=CASES["max_staleness"])
    rules.set_trainer_version(case["trainer_version"])
    assert rules.staleness_ok(case["sample_version"]) is case["admit"]
    if case["admit"]:
        rules.check_samples([11], [case["sample_version"]])
    else:
        with pytest.raises(StaleSample, match="sample 11"):
            rules.check_samples([11], [case["sample_version"]])


@pytest.mark.parametrize("case", CASES["replacement"], ids=lambda c: f"v{c['replacement_version']}")
async def test_replacement_version_must_equal_preflight(case):
    assert VersionRules.replacement_ok(case["preflight_version"], case["replacement_version"]) is case["admit"]
    clock = VersionClock(max_staleness=1)
    check = clock.check_replacements(case["preflight_version"], [3], [case["replacement_version"]])
    if case["admit"]:
        await check
    else:
        with pytest.raises(StaleSample, match="sample 3"):
            await check


def test_versions_never_decrease():
    seq, bad_at = CASES["monotonic"]["sequence"], CASES["monotonic"]["expect_error_at_index"]
    trainer, engine = VersionRules(), VersionRules()
    for i, version in enumerate(seq):
        if i == bad_at:
            with pytest.raises(VersionRegression):
                trainer.set_trainer_version(version)
            with pytest.raises(VersionRegression):
                engine.record_engine_load("engine_0", version)
        else:
            trainer.set_trainer_version(version)
            engine.record_engine_load("engine_0", version)


def test_state_round_trips():
    rules = VersionRules(max_staleness=2)
    rules.record_engine_load("engine_0", 0)
    rules.set_trainer_version(4)
    restored = VersionRules.from_state_dict(json.loads(json.dumps(rules.state_dict())))
    assert restored == rules
    with pytest.raises(VersionError):
        VersionRules(max_staleness=-1)


async def test_load_state_never_moves_versions_backwards_and_changes_nothing_when_refused():
    clock = VersionClock(max_staleness=1)
    await clock.set_trainer_version(5)
    await clock.record_engine_load("engine_0", 5)
    before = await clock.state()
    for state in ({"max_staleness": 1, "trainer_version": 0, "engine_versions": {}},  # 5 -> 0
                  {"max_staleness": 1, "trainer_version": 7, "engine_versions": {"engine_0": 4}}):
        with pytest.raises(VersionRegression):
            await clock.load_state(state)
        assert await clock.state() == before  # the trainer version 7 was not applied either
    with pytest.raises(VersionError, match="engine_versions"):
        await clock.load_state({"max_staleness": 1, "trainer_version": 9, "engine_versions": {"engine_1": -5}})
    with pytest.raises(VersionError, match="malformed"):
        await clock.load_state({"trainer_version": 9})
    assert await clock.state() == before
    await clock.load_state({"max_staleness": 3, "trainer_version": 6,
                            "engine_versions": {"engine_0": 6, "engine_1": 2}})
    assert await clock.state() == {"max_staleness": 1, "trainer_version": 6,
                                   "engine_versions": {"engine_0": 6, "engine_1": 2}}
