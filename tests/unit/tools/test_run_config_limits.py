"""Values that used to get past the configuration and fail inside an actor now fail up front."""
from __future__ import annotations

import json

import pytest

from replayrl.tools.cli import build_parser
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config, config_from_args


@pytest.mark.parametrize("values, flag", [
    ({"seed": -1}, "--seed"),
    ({"seed": 2 ** 70}, "--seed"),
    ({"engine-torch-threads": 0}, "--engine-torch-threads"),
    ({"trainer-torch-threads": 0}, "--trainer-torch-threads"),
    ({"weight-decay": -1.0}, "--weight-decay"),
    ({"rs-mode": "token", "rs-lower": float("inf"), "rs-upper": float("inf")}, "--rs-lower"),
    ({"rs-lower": 2.0, "rs-upper": 1.0}, "--rs-mode"),
    ({"rollout-top-k": 100000}, "--rollout-top-k"),
    ({"n-samples-per-prompt": 1}, "--n-samples-per-prompt"),
])
def test_out_of_range_values_name_their_flag(values, flag):
    with pytest.raises(ConfigError, match=flag):
        build_config(values)


@pytest.fixture(scope="module")
def checkpoint_256(tmp_path_factory):
    """An --hf-checkpoint of the default model: 256 positions."""
    from replayrl.tools.run.launcher import write_initial_checkpoint

    return str(write_initial_checkpoint(build_config({}), tmp_path_factory.mktemp("ckpt") / "init"))


@pytest.mark.parametrize("values, flag", [
    ({"rollout-max-response-len": 1000}, "--rollout-max-response-len"),
    ({"num-digits": 300}, "--num-digits"),
])
def test_contexts_longer_than_a_checkpoint_name_their_flag(values, flag, checkpoint_256):
    with pytest.raises(ConfigError, match=flag):
        build_config({**values, "hf-checkpoint": checkpoint_256})


def test_longest_context_is_exactly_the_model_limit(checkpoint_256):
    # 250 digits + 3 prompt tokens + 1 turn x (1 token + 2) = 256 positions: accepted
    assert build_config({"num-digits": 250, "rollout-max-response-len": 1,
                         "hf-checkpoint": checkpoint_256}).max_context_tokens == 256
    with pytest.raises(ConfigError, match="257 tokens"):
        build_config({"num-digits": 251, "rollout-max-response-len": 1, "hf-checkpoint": checkpoint_256})


def test_the_embedded_model_gets_the_positions_of_a_long_context():
    # 251 + 3 + 1 x (1 + 2) = 257: the embedded model is built with 257 positions (default RoPE
    # does not depend on the count, so shorter runs keep the default model's 256 and weights)
    assert build_config({"num-digits": 251, "rollout-max-response-len": 1}).policy_config \
        .max_position_embeddings == 257


def test_checkpoints_that_cannot_resume_are_rejected(tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "run_state.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable replayrl checkpoint.*run_state.json"):
        build_config({"load": str(corrupt)})
    done = tmp_path / "done"
    done.mkdir()
    (done / "run_state.json").write_text(json.dumps({"next_step": 4}))
    with pytest.raises(ConfigError, match="already completed 4 steps"):
        build_config({"load": str(done), "num-steps": 4})
    assert build_config({"load": str(done), "num-steps": 5}).load == str(done)


def test_a_load_of_a_model_directory_or_of_the_save_folder_says_what_was_meant(tmp_path):
    model = tmp_path / "checkpoint-init"  # what a run writes: an HF directory, no run state
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"run_state.json.*; a Hugging Face model directory "
                                          r"starts a run with --hf-checkpoint$"):
        build_config({"load": str(model)})
    save = tmp_path / "checkpoints"
    for n in (2, 10):  # step-10 is the latest by number, though "step-2" sorts after it as text
        (save / f"step-{n}").mkdir(parents=True)
        (save / f"step-{n}" / "run_state.json").write_text(json.dumps({"next_step": n}))
    with pytest.raises(ConfigError, match=r"; its checkpoints are the step-N folders inside, "
                                          r"e\.g\. --load .*step-10$"):
        build_config({"load": str(save)})


@pytest.mark.parametrize("name, text, match", [
    ("dup.json", json.dumps({"num_steps": 3, "num-steps": 4}), "given twice"),
    ("run.yaml", "num-steps: 3\n", "use a .toml or .json"),
    ("bad.toml", "rollout_batchsize = 4\n", "bad.toml: unknown key"),
])
def test_config_file_problems_name_the_file(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        config_from_args(build_parser().parse_args(["train", "--config", str(path)]))


def test_resume_with_other_data_settings_is_rejected(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    saved = build_config({}).data_settings()
    (ckpt / "run_state.json").write_text(json.dumps({"next_step": 2, "data_settings": saved}))
    assert build_config({"load": str(ckpt), "lr": 1e-3}).load == str(ckpt)  # optimizer may change
    with pytest.raises(ConfigError, match=r"--rollout-batch-size 16 -> 4"):
        build_config({"load": str(ckpt), "rollout-batch-size": 4})
