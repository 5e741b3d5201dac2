"""``replayrl train --colocate`` losing its engine with its process (docs/fault-tolerance.md):
the run ends with an error that names the lost actors, says why ``--engine-failure`` cannot
help and which checkpoint to ``--load``, and that checkpoint loads."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from replayrl.actors import ActorDied
from replayrl.tools.bench.fault_injection import faulty_specs
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import actor_specs, check_load, launch, write_initial_checkpoint

COLOCATED = ("version_clock", "engine_0", "rollout_manager", "trainer")


async def test_a_colocated_run_that_loses_its_engine_ends_naming_the_checkpoint_to_load(tmp_path):
    flags = {"num-steps": 3, "rollout-batch-size": 2, "n-samples-per-prompt": 2,
             "progress": False, "save-interval": 1, "colocate": True,
             "engine-failure": "regenerate", "output-dir": str(tmp_path / "run")}
    config = build_config(flags)
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    # engine_0 SIGKILLs its process in its third generate call (rollout 2): steps 0 and 1 train
    # on rollouts 0 and 1, so the step-1 checkpoint (after step 0) is complete by then
    specs = faulty_specs(actor_specs(config, checkpoint), "engine_0", "SIGKILL", 3,
                         tmp_path / "fault.json")
    with pytest.raises(ActorDied) as info:
        await launch(config, specs=specs)
    lost = info.value
    assert (lost.actor, lost.exitcode, lost.members) == ("version_clock", -signal.SIGKILL, COLOCATED)
    assert json.loads((tmp_path / "fault.json").read_text())["signal"] == "SIGKILL"
    # the last complete checkpoint, found here by listing the save directory
    saved = sorted((p for p in Path(config.save_dir).iterdir() if (p / "run_state.json").is_file()),
                   key=lambda p: int(p.name.removeprefix("step-")))
    assert saved and saved[0].name == "step-1"
    first = str(lost).splitlines()[0]
    assert first.startswith("actors 'version_clock', 'engine_0', 'rollout_manager', 'trainer' "
                            "(one process) exited with code -9; under --colocate")
    assert "--engine-failure cannot keep the run going" in first
    assert first.endswith(f"rerun the same command with --load {saved[-1]}")
    # that checkpoint loads: the rerun continues after its step
    again = build_config({**flags, "output-dir": str(tmp_path / "again"), "load": str(saved[-1])})
    assert check_load(again) == int(saved[-1].name.removeprefix("step-"))
