"""Which actor processes get ``OMP_WAIT_POLICY=PASSIVE`` (``idle_thread_env``): those of more
than one torch thread that share cores with another busy process, unless the user chose."""
from __future__ import annotations

import pytest

from replayrl.tools.run.config import build_config
from replayrl.tools.run.initial_files import Resolved
from replayrl.tools.run.launcher import actor_specs, idle_thread_env

RESOLVED = Resolved("replayrl.rollout.engines.embedded:EmbeddedEngine", "float32", "auto")
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.fixture(autouse=True)
def no_user_choice(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)


@pytest.mark.parametrize("settings, passive", [
    ({}, set()),  # one thread everywhere: nothing spins
    ({"trainer-backward-threads": 2}, {"trainer"}),
    ({"trainer-torch-threads": 2}, {"trainer"}),
    ({"trainer-torch-threads": 2, "trainer-backward-threads": 1}, {"trainer"}),
    ({"engine-torch-threads": 2, "num-engines": 2}, {"engine_0", "engine_1"}),
    ({"trainer-backward-threads": 2, "dp-size": 2}, {"trainer", "trainer_1"}),
    # cores of their own, or one process for engine and trainer: nothing to leave a core to
    ({"trainer-backward-threads": 2, "cpu-affinity": "split"}, set()),
    ({"colocate": True, "engine-torch-threads": 2, "trainer-torch-threads": 2}, set()),
])
def test_passive_exactly_where_threads_share_cores(settings, passive):
    config = build_config(settings)
    assert idle_thread_env(config) == {name: PASSIVE for name in passive}
    specs = actor_specs(config, "unused", resolved=RESOLVED)
    assert {s.name for s in specs if s.env.get("OMP_WAIT_POLICY")} == passive
    assert all(s.env.get("OMP_WAIT_POLICY") in (None, "PASSIVE") for s in specs)


def test_the_users_own_policy_wins(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # inherited by every child as it is
    config = build_config({"trainer-backward-threads": 2, "engine-torch-threads": 2})
    assert idle_thread_env(config) == {}
    assert all("OMP_WAIT_POLICY" not in s.env for s in actor_specs(config, "unused", resolved=RESOLVED))
