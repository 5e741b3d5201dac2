"""--cpu-affinity split: the trainer's process gets a core of its own (the split, and the
affinity a spawned actor really runs with)."""
from __future__ import annotations

import os
import tempfile

import pytest

from replayrl.actors import ActorSpec, Directory, Supervisor
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import actor_specs, split_cpus, write_initial_checkpoint


@pytest.mark.parametrize("allowed, trainer, others", [
    ([0, 1], (0,), (1,)),
    ([3, 1, 2, 0], (0, 1), (2, 3)),
    ([0, 1, 2], (0,), (1, 2)),
    ([5], (), ()),
])
def test_split(allowed, trainer, others):
    assert split_cpus(allowed) == (trainer, others)


def test_specs_carry_the_split_only_when_asked(tmp_path):
    on = build_config({"cpu-affinity": "split", "output-dir": str(tmp_path)})
    ckpt = write_initial_checkpoint(on, tmp_path / "init")
    trainer, others = split_cpus(os.sched_getaffinity(0))
    specs = {s.name: s.cpus for s in actor_specs(on, ckpt)}
    assert specs.pop("trainer") == trainer and set(specs.values()) == {others}
    off = build_config({"output-dir": str(tmp_path)})
    assert {s.cpus for s in actor_specs(off, ckpt)} == {()}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
async def test_a_spawned_actor_runs_on_its_cpus():
    cpu = max(os.sched_getaffinity(0))
    spec = ActorSpec("probe", "tests.actor_fixtures:AffinityProbe", cpus=(cpu,))
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:  # short: AF_UNIX path limit
        directory = Directory.for_run(run_dir, ["probe"])
        async with Supervisor([spec], directory, run_dir):
            assert await directory.ref("probe").call("cpus") == [cpu]
    assert len(os.sched_getaffinity(0)) >= 2  # the launcher's own affinity is untouched
