"""A checkpoint is complete or absent: ``save_checkpoint`` writes ``<step>.partial`` and renames
it last, so a run killed while writing leaves no ``step-N`` that ``--load`` or
``latest_checkpoint`` would take; the metrics rows a killed run leaves read back without the
line it was cut off in."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from replayrl.tools.run.checkpoint_dirs import latest_checkpoint
from replayrl.tools.run.metrics import earlier_rows
from replayrl.tools.run.train_loop import checkpoint_next_step, save_checkpoint


class Killed(Exception):
    """Stands for the process dying in the middle of the trainer's write."""


class _Trainer:
    def __init__(self, die: bool) -> None:
        self.die = die

    async def save_checkpoint(self, path: str) -> str:
        (Path(path) / "model").write_text("weights")
        if self.die:
            raise Killed
        (Path(path) / "trainer_state.pt").write_text("optimizer")
        return path


class _Clock:
    async def state(self) -> dict:
        return {"trainer_version": 3}


class _Manager:
    async def state(self, next_step: int, directory: str) -> dict:
        return {"next": next_step, "written_into": Path(directory).name}


class _Directory:
    def __init__(self, die: bool = False) -> None:
        self.actors = {"trainer": _Trainer(die), "version_clock": _Clock(),
                       "rollout_manager": _Manager()}

    def proxy(self, name: str):
        return self.actors[name]


class _Config:
    def data_settings(self) -> dict:
        return {"seed": 1}


async def test_a_save_that_dies_leaves_only_a_partial_directory_and_the_earlier_checkpoint(tmp_path):
    await save_checkpoint(_Directory(), tmp_path / "step-1", 1, _Config())
    with pytest.raises(Killed):
        await save_checkpoint(_Directory(die=True), tmp_path / "step-2", 2, _Config())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2.partial"]
    assert not (tmp_path / "step-2.partial" / "run_state.json").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"
    with pytest.raises(FileNotFoundError):  # what --load of the partial one would read first
        checkpoint_next_step(tmp_path / "step-2.partial")
    state = json.loads((tmp_path / "step-1" / "run_state.json").read_text())
    # the manager wrote into the partial directory, which was then renamed
    assert state["next_step"] == 1 and state["manager"] == {"next": 1, "written_into": "step-1.partial"}
    assert state["clock"] == {"trainer_version": 3} and state["data_settings"] == {"seed": 1}


async def test_saving_again_replaces_a_leftover_partial_and_an_older_checkpoint_of_that_name(tmp_path):
    with pytest.raises(Killed):
        await save_checkpoint(_Directory(die=True), tmp_path / "step-2", 2, _Config())
    await save_checkpoint(_Directory(), tmp_path / "step-2", 2, _Config())
    (tmp_path / "step-2" / "stale").write_text("from an earlier run into this --save directory")
    await save_checkpoint(_Directory(), tmp_path / "step-2", 2, _Config())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]
    assert sorted(p.name for p in (tmp_path / "step-2").iterdir()) == [
        "model", "run_state.json", "trainer_state.pt"]
    assert checkpoint_next_step(tmp_path / "step-2") == 2


def test_latest_checkpoint_takes_the_most_steps_of_the_complete_ones(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None
    for name, complete in (("step-2", True), ("step-10", True), ("step-11", False),
                           ("step-12.partial", True), ("step-x", True)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "run_state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-10"  # numbers, not names, compared


def test_a_last_metrics_line_cut_short_is_left_out_and_a_broken_earlier_one_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "reward_mean": 0.5}\n{"step": 1, "reward_mean": 0.25}\n{"step": 2, "rew')
    assert earlier_rows(path) == [{"step": 0, "reward_mean": 0.5}, {"step": 1, "reward_mean": 0.25}]
    path.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a metrics row"):
        earlier_rows(path)
