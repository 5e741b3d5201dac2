"""A megatron checkpoint records its parallel layout and is refused, before any process
starts, under another layout or by the other backend (docs/design/megatron.md#megatron-backend).
The state files are written by hand here; a real save's record is checked by
tests/system/test_megatron_backend.py's round trip."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import check_load, write_initial_checkpoint
from replayrl.trainer.backends.checkpoint_layout import CheckpointLayout
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import CheckpointLayoutError

pytest.importorskip("megatron.core")

from replayrl.trainer.backends.megatron_backend import MegatronBackend  # noqa: E402

TP2 = {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "dp": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_checkpoint(build_config({}), tmp_path_factory.mktemp("init") / "model")


def _megatron_checkpoint(directory: Path, model_dir: Path, ranks: int,
                         layout: dict | None) -> Path:
    """``ranks`` hand-written rank state files at version 3 (``layout`` None: a checkpoint
    from before layouts were recorded), the HF model next to them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model").symlink_to(model_dir, target_is_directory=True)
    for r in range(ranks):
        state = {"optimizer": [], "version": 3, "torch_rng": torch.get_rng_state()}
        if layout is not None:
            state["layout"] = layout
        torch.save(state, directory / f"trainer_state.rank{r}.pt")
    return directory


def test_a_checkpoint_is_refused_under_another_layout_naming_both(model_dir, tmp_path):
    ckpt = _megatron_checkpoint(tmp_path / "ckpt", model_dir, 2, TP2)
    # the tryout's case: a TP=2 checkpoint under --cp-size 2 (same rank count) used to LOAD
    with pytest.raises(CheckpointLayoutError) as info:
        MegatronBackend.check_checkpoint(ckpt, TrainerConfig(train_backend="megatron", cp_size=2))
    message = str(info.value)
    assert (f"checkpoint {ckpt} was saved with --tp-size 2 --pp-size 1 --cp-size 1 --ep-size 1 "
            f"--dp-size 1; this run asks for --tp-size 1 --pp-size 1 --cp-size 2 --ep-size 1 "
            f"--dp-size 1") in message
    assert f"--hf-checkpoint {ckpt / 'model'}" in message
    for other in (TrainerConfig(train_backend="megatron", pp_size=2),
                  TrainerConfig(train_backend="megatron", dp_size=2),
                  TrainerConfig(train_backend="megatron")):
        with pytest.raises(CheckpointLayoutError, match="was saved with --tp-size 2"):
            MegatronBackend.check_checkpoint(ckpt, other)
    assert MegatronBackend.check_checkpoint(ckpt, TrainerConfig(train_backend="megatron", tp_size=2)) == 3


def test_a_rank_file_missing_or_disagreeing_is_refused(model_dir, tmp_path):
    ckpt = _megatron_checkpoint(tmp_path / "ckpt", model_dir, 1, TP2)  # rank1's file lost
    with pytest.raises(CheckpointLayoutError, match="holds 1 trainer_state"):
        MegatronBackend.check_checkpoint(ckpt, TrainerConfig(train_backend="megatron", tp_size=2))
    torch.save({"optimizer": [], "version": 3, "torch_rng": torch.get_rng_state(),
                "layout": {**TP2, "tp": 1, "pp": 2}}, ckpt / "trainer_state.rank1.pt")
    with pytest.raises(ValueError, match="disagree on the layout"):
        MegatronBackend.check_checkpoint(ckpt, TrainerConfig(train_backend="megatron", tp_size=2))
    torch.save({"optimizer": [], "version": 3, "torch_rng": torch.get_rng_state(),
                "layout": {**TP2, "tp": 0}}, ckpt / "trainer_state.rank1.pt")
    with pytest.raises(ValueError, match=r"trainer_state.rank1.pt: layout.tp must be an int >= 1"):
        MegatronBackend.check_checkpoint(ckpt, TrainerConfig(train_backend="megatron", tp_size=2))


def test_a_checkpoint_without_a_layout_is_accepted_only_for_its_rank_count(model_dir, tmp_path):
    ckpt = _megatron_checkpoint(tmp_path / "ckpt", model_dir, 2, None)
    # two files: any two-rank layout passes (it cannot be told apart), other counts fail
    assert MegatronBackend.check_checkpoint(ckpt, TrainerConfig(train_backend="megatron", pp_size=2)) == 3
    with pytest.raises(CheckpointLayoutError, match=r"records no parallel layout and has 2 "
                                                    r"trainer_state.rank<r>.pt file\(s\); this run "
                                                    r"asks for .*\(1 trainer rank\(s\)\)"):
        MegatronBackend.check_checkpoint(ckpt, TrainerConfig(train_backend="megatron"))


def test_each_backend_names_the_one_that_wrote_the_checkpoint(model_dir, tmp_path):
    megatron = _megatron_checkpoint(tmp_path / "megatron", model_dir, 1, TP2 | {"tp": 1})
    with pytest.raises(CheckpointLayoutError, match=r"written by --train-backend megatron, this "
                                                    r"run uses --train-backend torch"):
        TorchBackend.check_checkpoint(megatron, TrainerConfig())
    backend = TorchBackend(str(model_dir), TrainerConfig(), list(VOCABULARY))
    with pytest.raises(CheckpointLayoutError, match="written by --train-backend megatron"):
        backend.load_checkpoint(megatron)
    backend.save_checkpoint(tmp_path / "torch", 3)
    with pytest.raises(CheckpointLayoutError, match=r"written by --train-backend torch, this "
                                                    r"run uses --train-backend megatron"):
        MegatronBackend.check_checkpoint(tmp_path / "torch", TrainerConfig(train_backend="megatron"))


def test_the_launcher_refuses_the_layout_before_any_process_starts(model_dir, tmp_path):
    ckpt = _megatron_checkpoint(tmp_path / "ckpt", model_dir, 2, TP2)
    clock = {"max_staleness": 1, "trainer_version": 3, "engine_versions": {}}
    (ckpt / "run_state.json").write_text(json.dumps({"next_step": 3, "clock": clock, "manager": {}}))
    base = {"load": str(ckpt), "num-steps": 5, "train-backend": "megatron",
            "output-dir": str(tmp_path / "out")}
    assert check_load(build_config({**base, "tp-size": 2})) == 3
    with pytest.raises(ConfigError, match=r"--load .*was saved with --tp-size 2 .*this run asks "
                                          r"for --tp-size 1 --pp-size 1 --cp-size 2"):
        check_load(build_config({**base, "cp-size": 2}))
    # the way out the message names: the checkpoint's HF weights start a fresh run
    fresh = build_config({"hf-checkpoint": str(ckpt / "model"), "output-dir": str(tmp_path / "o2")})
    assert fresh.policy_config == build_config({}).policy_config


def test_layout_flags_and_rank_count():
    layout = CheckpointLayout(tp=2, pp=1, cp=2, ep=4, dp=3)
    assert layout.flags() == "--tp-size 2 --pp-size 1 --cp-size 2 --ep-size 4 --dp-size 3"
    assert layout.ranks == 12  # EP splits the DP x TP x CP ranks, adds none
    assert CheckpointLayout.from_record(layout.record(), Path("f")) == layout


def test_every_torchrun_rank_refuses_the_layout_before_exchanging_addresses(
        model_dir, tmp_path, monkeypatch, capsys, curve_keys_dir):
    from replayrl.tools.run import torchrun_entry

    ckpt = _megatron_checkpoint(tmp_path / "ckpt", model_dir, 2, TP2)
    clock = {"max_staleness": 1, "trainer_version": 3, "engine_versions": {}}
    (ckpt / "run_state.json").write_text(json.dumps({"next_step": 3, "clock": clock, "manager": {}}))

    def no_exchange(*args, **kwargs):
        raise AssertionError("the ranks met before the checkpoint was checked")

    monkeypatch.setattr(torchrun_entry, "exchange_addresses", no_exchange)
    monkeypatch.setenv("WORLD_SIZE", "4")  # driver, engine, two trainer ranks
    for rank in ("0", "3"):  # the driver and a trainer rank alike
        monkeypatch.setenv("RANK", rank)
        code = torchrun_entry.main(["--load", str(ckpt), "--num-steps", "5", "--train-backend",
                                    "megatron", "--cp-size", "2", "--curve-keys",
                                    curve_keys_dir, "--output-dir", str(tmp_path / "out")])
        assert code == 2  # replayrl.tools.run.exit_codes: a configuration error
        assert "was saved with --tp-size 2" in capsys.readouterr().err
