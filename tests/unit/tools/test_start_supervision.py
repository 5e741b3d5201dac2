"""How long each actor of a run may take to start (``ready_timeouts``) and the line printed
while the launcher waits for one (``report_start_wait``)."""
from __future__ import annotations

import pytest

from replayrl.actors import ActorSpec
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import ready_timeouts, report_start_wait, start_supervision

NAMES = ("version_clock", "engine_0", "engine_1", "rollout_manager", "trainer")
SPECS = [ActorSpec(name, "module:Class") for name in NAMES]


@pytest.mark.parametrize("engine, extra", [
    ("embedded", 0.0),  # built in its constructor: an actor like any other
    ("vllm", 600.0),  # vllm.LLM starts in the constructor, up to --engine-start-timeout-seconds
    ("sglang", 600.0),  # waits there for its server's /health as long
])
def test_every_actor_gets_the_start_timeout_and_a_server_engine_its_own_start_on_top(engine, extra):
    flags = {"rollout-engine": engine, "num-engines": 2, "actor-start-timeout-seconds": 40.0}
    if engine == "sglang":
        flags["sglang-urls"] = "http://a:1,http://b:2"
    timeouts = ready_timeouts(build_config(flags), SPECS)
    assert timeouts == {"version_clock": 40.0, "engine_0": 40.0 + extra, "engine_1": 40.0 + extra,
                        "rollout_manager": 40.0, "trainer": 40.0}


def test_the_default_is_well_below_the_old_eleven_minutes():
    # the old wait was max(120, --engine-start-timeout-seconds + 60) = 660 s for every actor
    timeouts = ready_timeouts(build_config({}), SPECS)
    assert set(timeouts.values()) == {180.0}
    arguments = start_supervision(build_config({}), SPECS)
    assert arguments["ready_timeout"] == 180.0 and "--actor-start-timeout-seconds" in arguments["timeout_hint"]


def test_a_wait_is_one_line_naming_the_actor_the_time_and_the_flag(capsys):
    report_start_wait(["engine_0", "trainer"], 12.4, 180.0)
    report_start_wait(["trainer"], 27.0, 180.0)
    assert capsys.readouterr().err.splitlines() == [
        "replayrl: starting: waiting for engine_0 (then trainer), 12 s of at most 180 s "
        "(--actor-start-timeout-seconds)",
        "replayrl: starting: waiting for trainer, 27 s of at most 180 s (--actor-start-timeout-seconds)"]


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="actor-start-timeout-seconds"):
        build_config({"actor-start-timeout-seconds": 0})


def test_the_consoles_own_actors_get_the_same_start_timeout():
    from replayrl.tools.console.repl import ReplSession

    assert ReplSession(build_config({"actor-start-timeout-seconds": 40.0})).ready_timeout == 40.0
    assert ReplSession(build_config({}), ready_timeout=7.0).ready_timeout == 7.0
