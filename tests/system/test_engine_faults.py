"""Engine fault tolerance in real runs (docs/design/engine-faults.md#engine-faults).

An engine process of a two-engine run signals itself (SIGKILL, or SIGSTOP past the heartbeat
deadline) in the middle of the generation of rollout 1, which overlaps the training of step 0.
The reference is the same run without a fault, made here: the split of prompt groups over
engines and each chunk's seed do not depend on which engine serves it, so a regenerated chunk
(same weights, same request) gives the trajectories the lost engine would have given. Every
trained figure of every step must therefore equal the reference's, which proves that the step
trained on exactly the groups it would have (none lost, none twice) at the same versions.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from replayrl.actors import ActorDied, run_event_loop
from replayrl.tools.bench.fault_injection import faulty_specs
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import actor_specs, launch, write_initial_checkpoint

SMALL = {"rollout-batch-size": 4, "n-samples-per-prompt": 4, "progress": False,
         "num-engines": 2, "num-steps": 3}
# what a step trained on and what it computed; timings and the capacity figures differ
TRAINED = ("prompt_indices", "samples", "reward_mean", "response_len_mean", "trainer_version",
           "staleness_max", "staleness_mean", "grad_norm", "train_rollout_logprob_abs_diff",
           "accepted_tokens")


def _rows(result) -> list[dict]:
    return [json.loads(line) for line in result.metrics_path.read_text().splitlines()]


def _config(out: Path, **extra):
    return build_config({**SMALL, "output-dir": str(out), **extra})


async def _faulty_run(out: Path, signal: str, engine: str = "engine_1", **extra):
    config = _config(out, **extra)
    checkpoint = write_initial_checkpoint(config, out / "ckpt")
    # the engine's second request is its chunk of rollout 1 (the first is rollout 0's)
    specs = faulty_specs(actor_specs(config, checkpoint), engine, signal, 2, out / "fault.json")
    result = await launch(config, specs=specs)
    fault = json.loads((out / "fault.json").read_text())
    return result, fault


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The rows of the same run with no fault."""
    out = tmp_path_factory.mktemp("reference")
    return _rows(run_event_loop(launch(_config(out))))


def _children() -> set[int]:
    """Live child processes of this test process (the run's actors while it runs)."""
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                command = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            # multiprocessing's resource tracker lives as long as this process
            if (int(stat[1]) == os.getpid() and stat[0] != "Z"
                    and b"resource_tracker" not in command):
                kids.add(int(entry))
    return kids


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _assert_same_training(rows: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row, ref in zip(rows, reference):
        assert row["samples"] == 16  # 4 groups x 4, none lost, none twice
        for key in TRAINED:
            assert row[key] == ref[key], (row["step"], key)


@pytest.mark.parametrize("signal, deadline", [("SIGKILL", 30.0), ("SIGSTOP", 1.0)],
                         ids=["sigkill", "sigstop"])
async def test_lost_engine_groups_are_regenerated_and_the_step_trains_the_same(
        tmp_path, reference, signal, deadline):
    result, fault = await _faulty_run(tmp_path, signal, **{"engine-failure": "regenerate",
                                                           "heartbeat-deadline-s": deadline})
    rows = _rows(result)
    _assert_same_training(rows, reference)
    assert [r["staleness_max"] for r in rows] == [0, 1, 1]  # the one-step clock, unchanged
    # engine_1 carried groups 1 and 3 of rollout 1: both generated again on engine_0
    assert [r["groups_regenerated"] for r in rows] == [0, 2, 0]
    assert [r["engines_alive"] for r in rows] == [2, 1, 1]
    assert [r["engines_alive"] for r in reference] == [2, 2, 2]
    assert _gone(fault["pid"])  # a stopped engine was killed, not left behind


async def test_a_lost_member_of_the_weight_group_is_left_out_and_the_steps_train_the_same(
        tmp_path, reference):
    # --weight-sync dist: engine_1 dies while it generates rollout 1; the push after step 0
    # finds it gone, and goes to engine_0 alone, in a weight group formed without it
    result, fault = await _faulty_run(tmp_path, "SIGKILL", **{"engine-failure": "regenerate",
                                                               "weight-sync": "dist"})
    rows = _rows(result)
    _assert_same_training(rows, reference)
    assert [r["groups_regenerated"] for r in rows] == [0, 2, 0]
    assert [r["engines_alive"] for r in rows] == [2, 1, 1]
    assert _gone(fault["pid"])


@pytest.mark.parametrize("sync", ["auto", "dist"])
async def test_restarted_engine_serves_the_lost_groups_at_the_current_version(tmp_path, sync):
    # one engine: its loss leaves none, so rollout 1 waits for the new process, which serves
    # only after it loaded the trainer's weights of that moment (version 1, after step 0);
    # under dist it gets them through zmq, then joins a new weight group at the next push
    result, fault = await _faulty_run(tmp_path, "SIGKILL", **{"engine-failure": "restart",
                                                              "num-engines": 1,
                                                              "weight-sync": sync},
                                      engine="engine_0")
    rows = _rows(result)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["samples"] == 16 for r in rows)
    assert [r["groups_regenerated"] for r in rows] == [0, 4, 0]
    assert [r["engines_alive"] for r in rows] == [1, 1, 1]
    assert [r["trainer_version"] for r in rows] == [1, 2, 3]
    # rollout 1 came from version 1 weights, not the version 0 it was asked at: staleness 0
    assert [r["staleness_max"] for r in rows] == [0, 0, 1]
    assert rows[1]["staleness_mean"] == 0.0
    assert _gone(fault["pid"])


async def test_engine_failure_fail_ends_the_run_with_the_engine(tmp_path):
    with pytest.raises(ActorDied) as died:
        await _faulty_run(tmp_path, "SIGKILL", **{"engine-failure": "fail"})
    assert died.value.actor == "engine_1" and died.value.exitcode == -9


async def test_a_stopped_trainer_ends_the_run_at_the_deadline_keeping_the_checkpoint(tmp_path):
    from replayrl.tools.run.launcher import check_load

    config = _config(tmp_path, **{"num-engines": 1, "save-interval": 1,
                                  "heartbeat-deadline-s": 1.0})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    # its second train call is step 1, after the checkpoint of step 0 (step-1)
    specs = faulty_specs(actor_specs(config, checkpoint), "trainer", "SIGSTOP", 2,
                         tmp_path / "fault.json")
    with pytest.raises(ActorDied) as died:
        await launch(config, specs=specs)
    assert died.value.actor == "trainer" and "heartbeat deadline" in str(died.value)
    assert _gone(json.loads((tmp_path / "fault.json").read_text())["pid"])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    resume = _config(tmp_path / "again", **{"num-engines": 1,
                                            "load": str(tmp_path / "checkpoints" / "step-1")})
    assert check_load(resume) == 1


# killed during step 1: the clock when it records version 2, the manager when asked rollout 2
@pytest.mark.parametrize("actor, call", [("version_clock", 2), ("rollout_manager", 3)])
async def test_a_killed_clock_or_manager_ends_the_run_keeping_the_checkpoint(tmp_path, actor,
                                                                             call):
    from replayrl.tools.run.launcher import check_load

    config = _config(tmp_path, **{"num-engines": 1, "save-interval": 1})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    specs = faulty_specs(actor_specs(config, checkpoint), actor, "SIGKILL", call,
                         tmp_path / "fault.json")
    before = _children()
    with pytest.raises(ActorDied) as died:
        await launch(config, specs=specs)
    assert died.value.actor == actor and died.value.exitcode == -9
    assert not _children() - before  # every other actor stopped too
    # the checkpoint after step 0 is the last, complete and loadable
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    resume = _config(tmp_path / "again", **{"num-engines": 1,
                                            "load": str(tmp_path / "checkpoints" / "step-1")})
    assert check_load(resume) == 1
