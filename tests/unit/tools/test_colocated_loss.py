"""The error of a ``--colocate`` run that lost its colocated process: which losses it explains
and the checkpoint it names (the real loss: tests/system/test_colocate_loss.py)."""
from __future__ import annotations

import pickle

from replayrl.actors import ActorDied
from replayrl.tools.run.colocated_loss import explain_colocated_loss
from replayrl.tools.run.from_flags import build_config

MEMBERS = ("version_clock", "engine_0", "rollout_manager", "trainer")


def _config(tmp_path, **flags):
    return build_config({"colocate": True, "output-dir": str(tmp_path), **flags})


def test_the_named_checkpoint_is_the_highest_complete_one(tmp_path):
    for name, complete in (("step-2", True), ("step-10", True), ("step-11.partial", True),
                           ("step-12", False)):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        if complete:
            (tmp_path / "checkpoints" / name / "run_state.json").write_text("{}")
    died = ActorDied("version_clock", -9, "", MEMBERS)
    lost = explain_colocated_loss(_config(tmp_path, **{"save-interval": 2}), died, MEMBERS)
    assert isinstance(lost, ActorDied) and (lost.actor, lost.exitcode, lost.members) == ("version_clock", -9, MEMBERS)
    assert str(lost) == (
        "actors 'version_clock', 'engine_0', 'rollout_manager', 'trainer' (one process) exited "
        "with code -9; under --colocate engine_0 shares this process with the trainer, the "
        "version clock and the rollout manager, so --engine-failure cannot keep the run going "
        "(it applies to engines of their own, --num-engines above 1); the last complete "
        f"checkpoint is {tmp_path}/checkpoints/step-10: rerun the same command with --load "
        f"{tmp_path}/checkpoints/step-10")
    again = pickle.loads(pickle.dumps(lost))
    assert type(again) is ActorDied and str(again) == str(lost)  # the note survives a pickle
    assert explain_colocated_loss(_config(tmp_path), lost, MEMBERS) is lost  # noted once


def test_without_checkpoints_it_says_a_rerun_starts_over_and_keeps_the_traceback(tmp_path):
    died = ActorDied("version_clock", 1, "Traceback ...\nMemoryError", MEMBERS)
    lost = explain_colocated_loss(_config(tmp_path), died, MEMBERS)
    first, *rest = str(lost).splitlines()
    assert first.endswith("(one process) exited with code 1; under --colocate engine_0 shares "
                          "this process with the trainer, the version clock and the rollout "
                          "manager, so --engine-failure cannot keep the run going (it applies to "
                          "engines of their own, --num-engines above 1); no checkpoint was "
                          "complete (--save-interval): a rerun starts over")
    assert rest == ["--- traceback (version_clock) ---", "Traceback ...", "MemoryError"]


def test_any_other_loss_is_returned_as_it_is(tmp_path):
    engine = ActorDied("engine_1", -9)  # an engine of its own: --engine-failure's business
    assert explain_colocated_loss(_config(tmp_path, **{"num-engines": 2}), engine, MEMBERS) is engine
    trainer = ActorDied("trainer", -9)  # no --colocate: nothing is colocated
    assert explain_colocated_loss(build_config({"output-dir": str(tmp_path)}), trainer, ()) is trainer
