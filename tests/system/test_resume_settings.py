"""A setting given at resume is what runs: every setting a checkpoint restores either takes the
user's value (clock window, optimizer hyperparameters) or the run refuses (data settings, in
tests/unit/tools/test_run_config_limits.py); and every JSON file a real run writes is strict JSON."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from replayrl.actors.errors import StaleSample
from replayrl.actors.version_clock import VersionClock
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.cli import build_parser
from replayrl.tools.run.from_flags import build_config, config_from_args
from replayrl.tools.run.launcher import launch, write_initial_checkpoint
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.config import TrainerConfig

SMALL = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "progress": False}


@pytest.fixture
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the trainer backend sets the process's threads


async def test_restored_clock_enforces_the_resumed_runs_max_staleness():
    clock = VersionClock(max_staleness=3)  # the resumed run's --max-staleness 3
    await clock.load_state({"max_staleness": 1, "trainer_version": 5, "engine_versions": {"e": 5}})
    state = await clock.state()
    assert state == {"max_staleness": 3, "trainer_version": 5, "engine_versions": {"e": 5}}
    assert await clock.check_samples([1], [2]) == 5  # 5 - 2 = 3 <= 3: admitted
    with pytest.raises(StaleSample):
        await clock.check_samples([2], [1])  # 5 - 1 = 4 > 3


def test_restored_optimizer_takes_the_resumed_runs_hyperparameters(tmp_path, _restore_threads):
    checkpoint = write_initial_checkpoint(build_config({}), tmp_path / "init")
    saved = TorchBackend(checkpoint, TrainerConfig(lr=3e-4, weight_decay=0.0), list(VOCABULARY))
    for p in saved.params:
        p.grad = torch.ones_like(p)
    saved.clip_and_step(1.0)
    saved.save_checkpoint(tmp_path / "ckpt", 1)
    saved_moments = {k: v for k, v in saved.digest().items() if k.startswith("opt/")}

    resumed = TorchBackend(checkpoint, TrainerConfig(lr=1e-3, weight_decay=0.1), list(VOCABULARY))
    assert resumed.load_checkpoint(tmp_path / "ckpt") == 1
    group = resumed.optimizer.param_groups[0]
    # the flags given at resume, not the checkpoint's 3e-4 / 0.0
    assert (group["lr"], group["weight_decay"], group["betas"]) == (1e-3, 0.1, (0.9, 0.98))
    # the state itself (moments, step counts) is the checkpoint's
    assert {k: v for k, v in resumed.digest().items() if k.startswith("opt/")} == saved_moments
    steps = {float(s["step"]) for s in resumed.optimizer.state_dict()["state"].values()}
    assert steps == {1.0}


def _refuse(name: str):
    raise AssertionError(f"not strict JSON: {name}")


def _strict_json_files(root: Path) -> list[str]:
    """Parse every .json file and every .jsonl line under ``root`` with a parser that refuses
    NaN / Infinity; returns the relative paths parsed."""
    seen = []
    for path in sorted(root.rglob("*.json*")):
        if path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                json.loads(line, parse_constant=_refuse)
        elif path.suffix == ".json":
            json.loads(path.read_text(), parse_constant=_refuse)
        else:
            continue
        seen.append(str(path.relative_to(root)))
    return seen


async def test_a_real_run_and_its_resume_write_strict_json_that_reads_back(tmp_path):
    first = build_config({**SMALL, "num-steps": 2, "save-interval": 1,
                          "output-dir": str(tmp_path / "first")})
    await launch(first)
    written = _strict_json_files(tmp_path / "first")
    for expected in ("config.json", "metrics.jsonl", "checkpoints/step-1/run_state.json",
                     "checkpoints/step-1/model/config.json", "checkpoint-init/config.json"):
        assert expected in written
    record = json.loads((tmp_path / "first" / "config.json").read_text(), parse_constant=_refuse)
    assert record["trainer"]["rs_upper"] is None  # the absent bound, not Infinity
    # the record read back with --config is the run's config, the absent bound included
    back = config_from_args(build_parser().parse_args(
        ["train", "--config", str(tmp_path / "first" / "config.json")]))
    assert back == first and back.trainer.rs_upper == math.inf
    # the default checkpoint directory follows the --output-dir of a run that reuses the record
    elsewhere = config_from_args(build_parser().parse_args(
        ["train", "--config", str(tmp_path / "first" / "config.json"),
         "--output-dir", str(tmp_path / "other")]))
    assert elsewhere.save_dir == str(tmp_path / "other" / "checkpoints")

    # resume with other --max-staleness / --lr: accepted, recorded, and (tests above) what runs
    resumed = build_config({**SMALL, "num-steps": 3, "load": str(tmp_path / "first" / "checkpoints" / "step-1"),
                            "max-staleness": 3, "lr": 1e-3, "output-dir": str(tmp_path / "resumed")})
    result = await launch(resumed)
    assert [r["step"] for r in result.rows] == [1, 2]
    _strict_json_files(tmp_path / "resumed")
    record = json.loads((tmp_path / "resumed" / "config.json").read_text())
    assert record["max_staleness"] == 3 and record["trainer"]["lr"] == 1e-3


@pytest.mark.parametrize("damage", ["none", "truncated-model", "truncated-state", "clock",
                                    "model-size", "no-indexer"])
async def test_load_is_checked_before_any_actor_starts(tmp_path, _restore_threads, damage):
    from replayrl.actors.child_process import live_children
    from replayrl.tools.errors import ConfigError
    from replayrl.tools.run.launcher import check_load
    from replayrl.transport import strict_json

    base = build_config({**SMALL, "num-steps": 3, "output-dir": str(tmp_path / "out")})
    saved = TorchBackend(write_initial_checkpoint(base, tmp_path / "init"), base.trainer, list(VOCABULARY))
    ckpt = tmp_path / "ckpt"
    saved.save_checkpoint(ckpt, 1)
    clock = {"max_staleness": 1, "trainer_version": 1, "engine_versions": {"engine_0": 1}}
    (ckpt / "run_state.json").write_text(strict_json.dumps(
        {"next_step": 1, "data_settings": base.data_settings(), "clock": clock, "manager": {}}))
    if damage == "truncated-model":
        weights = next((ckpt / "model").glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "truncated-state":
        state = ckpt / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    elif damage == "clock":
        (ckpt / "run_state.json").write_text(strict_json.dumps(
            {"next_step": 1, "data_settings": base.data_settings(), "manager": {},
             "clock": {**clock, "engine_versions": {"engine_0": -5}}}))
    # another run's model: the saved 1m policy (with its indexer) against a 10m one, or one
    # without the indexer (its three indexer tensors in the first indexed layer unexpected)
    model_flags = {"model-size": {"model-size": "10m"}, "no-indexer": {"model-indexer": False}}
    config = build_config({**SMALL, "num-steps": 3, "output-dir": str(tmp_path / "out"), "load": str(ckpt),
                           **model_flags.get(damage, {})})
    if damage == "none":
        assert check_load(config) == 1
        return
    with pytest.raises(ConfigError, match=f"--load {ckpt}") as info:
        await launch(config)
    if damage == "model-size":
        # the 1m preset has layers 0-3; 10m's first tensor beyond them, in name order
        assert "it lacks 'model.layers.4.input_layernorm.weight'" in str(info.value)
    if damage == "no-indexer":
        assert "this run's policy has not" in str(info.value)
        assert ".self_attn.indexer." in str(info.value)
    assert live_children() == []  # refused before any actor process started
    assert not (tmp_path / "out" / "checkpoint-init").exists()
