"""An ``ActorSpec.env`` (``GOMP_SPINCOUNT``, ``idle_thread_env``) reaches a spawned actor before
anything in it loads torch: libgomp reads it once, when torch loads it."""
from __future__ import annotations

import tempfile

from replayrl.actors import ActorSpec, Directory, Supervisor


async def test_spec_env_is_set_before_torch_loads():
    spec = ActorSpec("probe", "tests.actor_fixtures:EnvProbe", env={"GOMP_SPINCOUNT": "30000"})
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:  # short: AF_UNIX path limit
        directory = Directory.for_run(run_dir, ["probe"])
        async with Supervisor([spec], directory, run_dir):
            probe = directory.ref("probe")
            assert await probe.call("env", "GOMP_SPINCOUNT") == "30000"
            # the child's start-up (spawn's re-import of the launcher, the actor module) loaded no
            # torch, so the trainer's torch, imported with its actor class, sees the policy
            assert await probe.call("torch_loaded") is False
