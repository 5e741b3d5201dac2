"""Which actor processes get a short libgomp spin (``GOMP_SPINCOUNT``, ``idle_thread_env``):
those of more than one torch thread that share cores with another busy process, unless the user
chose a policy."""
from __future__ import annotations

import pytest

from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.initial_files import Resolved
from replayrl.tools.run.launcher import actor_specs, idle_thread_env

RESOLVED = Resolved("replayrl.rollout.engines.embedded:EmbeddedEngine", "float32", "auto")
SHORT = {"GOMP_SPINCOUNT": "30000"}  # a tenth of libgomp's default 300000


@pytest.fixture(autouse=True)
def no_user_choice(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)


@pytest.mark.parametrize("settings, short", [
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
def test_short_spin_exactly_where_threads_share_cores(settings, short):
    config = build_config(settings)
    assert idle_thread_env(config) == {name: SHORT for name in short}
    specs = actor_specs(config, "unused", resolved=RESOLVED)
    assert {s.name for s in specs if "GOMP_SPINCOUNT" in s.env} == short
    assert all(s.env.get("GOMP_SPINCOUNT") in (None, "30000") for s in specs)


@pytest.mark.parametrize("name, value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "0")])
def test_the_users_own_policy_wins(monkeypatch, name, value):
    monkeypatch.setenv(name, value)  # inherited by every child as it is
    config = build_config({"trainer-backward-threads": 2, "engine-torch-threads": 2})
    assert idle_thread_env(config) == {}
    assert all("GOMP_SPINCOUNT" not in s.env for s in actor_specs(config, "unused", resolved=RESOLVED))
