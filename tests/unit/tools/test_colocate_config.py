"""``--colocate`` (docs/design/actors.md#colocate): what it refuses before any process starts, which
actors share the colocated process, and which engines stay expendable."""
from __future__ import annotations

from pathlib import Path

import pytest

from replayrl.actors import DRIVER, ActorDied, Directory, Supervisor
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.initial_files import Resolved
from replayrl.tools.run.launcher import COLOCATED, actor_specs, engine_supervision
from replayrl.tools.run.torchrun_entry import refuse_colocate

RESOLVED = Resolved("replayrl.rollout.engines.embedded:EmbeddedEngine", "float32", "auto")


@pytest.mark.parametrize("settings, flags", [
    ({"engine-failure": "restart"}, ["--engine-failure restart"]),
    ({"dp-size": 2}, ["--dp-size 2"]),
    ({"cpu-affinity": "split"}, ["--cpu-affinity split"]),
    ({"engine-torch-threads": 2}, ["--engine-torch-threads 2", "--trainer-torch-threads 1"]),
    ({"trainer-torch-threads": 2}, ["--engine-torch-threads 1", "--trainer-torch-threads 2"]),
    ({"trainer-backward-threads": 2}, ["--trainer-backward-threads 2"]),
])
def test_combinations_colocate_cannot_serve_are_refused_naming_the_flags(settings, flags):
    build_config(settings)  # each is a valid run without --colocate
    with pytest.raises(ConfigError, match="--colocate") as info:
        build_config({"colocate": True, **settings})
    assert all(flag in str(info.value) for flag in flags)


def test_every_colocate_conflict_is_named_in_one_refusal():
    with pytest.raises(ConfigError) as info:
        build_config({"colocate": True, "dp-size": 2, "cpu-affinity": "split",
                      "engine-failure": "restart", "trainer-torch-threads": 2})
    message = str(info.value)
    for flag in ("--engine-failure restart", "--dp-size 2", "--cpu-affinity split",
                 "--trainer-torch-threads 2"):
        assert flag in message, flag
    assert message.count("--colocate with") == 4


def test_colocate_threads_alone_is_refused_naming_both_flags():
    # without --colocate the flag would place nothing: a silent no-op is refused instead
    with pytest.raises(ConfigError, match="--colocate-threads without --colocate"):
        build_config({"colocate-threads": True})
    build_config({"colocate": True, "colocate-threads": True})


@pytest.mark.parametrize("settings", [
    {},
    {"engine-failure": "fail"},
    {"engine-torch-threads": 2, "trainer-torch-threads": 2},
    {"engine-torch-threads": 2, "trainer-torch-threads": 2, "trainer-backward-threads": 2},
    {"num-engines": 2, "engine-failure": "regenerate"},
    {"max-staleness": 0},
])
def test_combinations_colocate_serves_are_accepted(settings):
    assert build_config({"colocate": True, **settings}).colocate


def test_the_clock_manager_engine_0_and_trainer_share_the_colocated_process(tmp_path):
    config = build_config({"colocate": True, "num-engines": 2, "output-dir": str(tmp_path)})
    specs = actor_specs(config, Path(tmp_path), resolved=RESOLVED)
    assert {s.name: s.process for s in specs} == {
        "version_clock": COLOCATED, "engine_0": COLOCATED, "rollout_manager": COLOCATED,
        "trainer": COLOCATED, "engine_1": ""}
    # by default one event loop; --colocate-threads: engine_0 and the trainer on threads of their own
    assert not any(s.thread for s in specs)
    threads = build_config({"colocate": True, "colocate-threads": True, "output-dir": str(tmp_path)})
    assert {s.name for s in actor_specs(threads, Path(tmp_path), resolved=RESOLVED) if s.thread} == {
        "engine_0", "trainer"}
    # the engine of the colocated process is lost with the trainer: only engine_1 is expendable
    directory = Directory.for_run(tmp_path, [s.name for s in specs])
    supervision = engine_supervision(config, directory)
    assert (supervision["expendable"], supervision["on_lost"]) == (("engine_1",), "drop")
    assert supervision["kept"] == ("engine_0",)
    sup = Supervisor(specs, directory, tmp_path, **supervision)
    assert [[s.name for s in g] for g in sup.groups.values()] == [
        ["version_clock", "engine_0", "rollout_manager", "trainer"], ["engine_1"]]
    # engine_1 exits: the run goes on with the colocated engine_0 (it used to end the run, since
    # every *expendable* engine was lost); the colocated process exiting still ends it
    live, dead = _FakeProcess(None), _FakeProcess(-9)
    sup.processes = {name: live for name in ("version_clock", "engine_0", "rollout_manager", "trainer")}
    sup.processes["engine_1"] = dead
    sup._silent = lambda name: None  # no heartbeats here: only exits are judged
    sup._check()
    assert list(sup.dropped) == ["engine_1"]
    live.exitcode = 1
    with pytest.raises(ActorDied, match="engine_0|version_clock"):
        sup._check()


class _FakeProcess:
    """What Supervisor._check reads of a process: its exit code (None while it runs)."""

    def __init__(self, exitcode):
        self.exitcode = exitcode

    def join(self, timeout=None):
        pass


def test_without_colocate_the_launcher_serves_clock_and_manager_the_rest_apart(tmp_path):
    config = build_config({"output-dir": str(tmp_path), "num-engines": 2})
    specs = actor_specs(config, Path(tmp_path), resolved=RESOLVED)
    assert {s.name: s.process for s in specs} == {
        "version_clock": DRIVER, "rollout_manager": DRIVER, "engine_0": "", "engine_1": "", "trainer": ""}
    assert not any(s.thread for s in specs)
    assert engine_supervision(config, Directory.for_run(tmp_path, ["x"]))["expendable"] == ("engine_0", "engine_1")


def test_torchrun_refuses_colocate():
    refuse_colocate(build_config({}))
    with pytest.raises(ConfigError, match="--colocate is not available under torchrun"):
        refuse_colocate(build_config({"colocate": True}))


def test_the_peer_bench_prints_the_colocated_side_settings():
    from replayrl.tools.bench.peer import settings_table

    rows = {line.split(" | ")[0]: line for line in settings_table(build_config({"colocate": True})).splitlines()}
    assert "--colocate: clock, manager, engine and trainer in one process" in rows["| threads"]
    assert "take turns in one process" in rows["| staleness"]
    alone = settings_table(build_config({}))
    assert "--colocate" not in alone and "(one process each)" in alone
