"""Run configuration precedence and validation (tools/run/config.py) and edge_means (tools/run/metrics.py)."""

from __future__ import annotations

import json

import pytest

from replayrl.rollout.config import RolloutConfig
from replayrl.tools.cli import build_parser
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.config import RunConfig
from replayrl.tools.run.from_flags import build_config, config_from_args
from replayrl.tools.run.metrics import edge_means
from replayrl.trainer.config import TrainerConfig


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- precedence


def test_defaults_without_file_or_flags():
    cfg = parse()
    assert (cfg.num_steps, cfg.max_staleness, cfg.num_engines) == (400, 1, 1)
    assert (cfg.engine_dtype, cfg.transport, cfg.output_dir, cfg.progress) == ("auto", "ipc", "runs/default", True)
    assert (cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.top_k) == (16, 8, 20)
    assert (cfg.rollout.temperature, cfg.trainer.temperature) == (1.0, 1.0)
    assert (cfg.trainer.lr, cfg.trainer.tis_cap, cfg.trainer.use_support_replay) == (3e-4, 2.0, True)


def test_build_config_from_an_empty_mapping_equals_the_defaults():
    assert build_config({}).to_dict() == RunConfig().to_dict()


def test_toml_file_with_dashes_and_underscores_overrides_defaults(tmp_path):
    path = write(tmp_path, "run.toml", """
num-steps = 7
rollout_batch_size = 4
n-samples-per-prompt = 2
lr = 0.01
use_routing_replay = false
engine-dtype = "float32"
""")
    cfg = parse("--config", path)
    assert cfg.num_steps == 7
    assert cfg.rollout.rollout_batch_size == 4 and cfg.rollout.n_samples_per_prompt == 2
    assert cfg.trainer.lr == 0.01 and cfg.trainer.use_routing_replay is False
    assert cfg.engine_dtype == "float32"
    assert cfg.rollout.top_k == 20  # untouched keys keep their defaults


def test_json_file_with_dashes_and_underscores_overrides_defaults(tmp_path):
    path = write(tmp_path, "run.json", json.dumps({
        "max_staleness": 2, "rollout-top-k": -1, "tis_cap": 3.5, "grpo-std-normalization": True,
        "output_dir": "runs/x",
    }))
    cfg = parse("--config", path)
    assert cfg.max_staleness == 2 and cfg.rollout.top_k == -1 and cfg.trainer.tis_cap == 3.5
    assert cfg.trainer.normalize_advantage_std is True and cfg.output_dir == "runs/x"


def test_flags_override_the_config_file(tmp_path):
    path = write(tmp_path, "run.toml", "num-steps = 7\nrollout-batch-size = 4\nuse-support-replay = true\n")
    cfg = parse("--config", path, "--num-steps", "9", "--no-use-support-replay")
    assert cfg.num_steps == 9  # flag wins
    assert cfg.rollout.rollout_batch_size == 4  # file value where no flag is given
    assert cfg.trainer.use_support_replay is False


def test_flags_without_a_file_override_defaults(curve_keys_dir):
    cfg = parse("--rollout-top-p", "0.9", "--micro-batch-size", "3", "--transport", "tcp", "--no-progress",
                "--curve-keys", curve_keys_dir)
    assert cfg.rollout.top_p == 0.9 and cfg.trainer.micro_batch_size == 3
    assert cfg.transport == "tcp" and cfg.progress is False


def test_tcp_without_keys_is_a_configuration_error(tmp_path):
    with pytest.raises(ConfigError, match="--curve-keys"):
        parse("--transport", "tcp")
    (tmp_path / "run.key_secret").write_text("not a key")
    with pytest.raises(ConfigError, match="--curve-keys"):
        parse("--transport", "tcp", "--curve-keys", str(tmp_path))


def test_rollout_temperature_reaches_rollout_and_trainer(tmp_path):
    cfg = parse("--rollout-temperature", "0.7")
    assert cfg.rollout.temperature == 0.7 and cfg.trainer.temperature == 0.7
    path = write(tmp_path, "t.toml", "rollout_temperature = 0.5\n")
    cfg = parse("--config", path)
    assert cfg.rollout.temperature == 0.5 and cfg.trainer.temperature == 0.5


def test_seed_reaches_rollout_and_trainer():
    cfg = parse("--seed", "17")
    assert cfg.rollout.seed == 17 and cfg.trainer.seed == 17


def test_repl_subcommand_takes_the_same_flags():
    args = build_parser().parse_args(["repl", "--num-steps", "3"])
    assert config_from_args(args).num_steps == 3


# ---------------------------------------------------------------- errors name the flag


@pytest.mark.parametrize("flag,value", [
    ("num-steps", 0),
    ("max-staleness", -1),
    ("num-engines", 0),
    ("engine-dtype", "float16"),
    ("transport", "udp"),
    ("rollout-batch-size", 0),
    ("n-samples-per-prompt", 0),
    ("rollout-temperature", 0.0),
    ("rollout-temperature", -1.0),
    ("rollout-top-k", 0),
    ("rollout-top-k", -2),
    ("rollout-top-p", 0.0),
    ("rollout-top-p", 1.5),
    ("rollout-min-p", 1.0),
    ("rollout-min-p", -0.1),
    ("rollout-max-response-len", 0),
    ("rollout-timeout-seconds", 0.0),
    ("lr", -1e-3),
    ("clip-grad", 0.0),
    ("eps-clip", 0.0),
    ("eps-clip", 1.0),
    ("eps-clip-high", 0.0),
    ("tis-cap", 0.0),
    ("micro-batch-size", 0),
    ("rpc-timeout-seconds", 0.0),
])
def test_bad_value_raises_config_error_naming_the_flag(flag, value):
    with pytest.raises(ConfigError, match=f"--{flag}"):
        build_config({flag: value})
    with pytest.raises(ConfigError, match=f"--{flag}"):
        parse(f"--{flag}", str(value))


def test_temperature_mismatch_between_sides_names_the_flag():
    with pytest.raises(ConfigError, match="--rollout-temperature"):
        RunConfig(rollout=RolloutConfig(temperature=0.5), trainer=TrainerConfig(temperature=1.0))


@pytest.mark.parametrize("key", ["not-a-flag", "dataset-size", "temperature", "config"])
def test_unknown_key_is_rejected_by_name(key):
    with pytest.raises(ConfigError, match=f"--{key}"):
        build_config({key: 1})


def test_unknown_key_in_a_config_file_is_rejected(tmp_path):
    path = write(tmp_path, "bad.toml", "num-steps = 3\nrollout_batchsize = 4\n")
    with pytest.raises(ConfigError, match="rollout-batchsize"):
        parse("--config", path)


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match="--config"):
        parse("--config", str(tmp_path / "absent.toml"))
    with pytest.raises(ConfigError, match="--config"):
        parse("--config", write(tmp_path, "broken.toml", "num-steps = = 3\n"))
    with pytest.raises(ConfigError, match="--config"):
        parse("--config", write(tmp_path, "broken.json", "{\"num-steps\": 3"))


def test_wrongly_typed_file_value_names_the_flag(tmp_path):
    path = write(tmp_path, "typed.json", json.dumps({"rollout_batch_size": "16"}))
    with pytest.raises(ConfigError, match="--rollout-batch-size"):
        parse("--config", path)


def test_fractional_num_steps_in_file_is_rejected(tmp_path):
    path = write(tmp_path, "frac.toml", "num-steps = 2.5\n")
    with pytest.raises(ConfigError, match="--num-steps"):
        parse("--config", path)


def test_json_config_that_is_not_an_object_is_a_config_error(tmp_path):
    path = write(tmp_path, "list.json", "[1, 2]")
    with pytest.raises(ConfigError, match="--config"):
        parse("--config", path)


# ---------------------------------------------------------------- edge_means


@pytest.mark.parametrize("values,expected", [
    ([4.0], (4.0, 4.0)),                                   # k = max(1, ceil(0.1)) = 1
    ([float(i) for i in range(9)], (0.0, 8.0)),            # k = ceil(0.9) = 1
    ([float(i) for i in range(10)], (0.0, 9.0)),           # k = ceil(1.0) = 1
    ([float(i) for i in range(11)], (0.5, 9.5)),           # k = ceil(1.1) = 2: (0+1)/2, (9+10)/2
    ([float(i) for i in range(20)], (0.5, 18.5)),          # k = 2
    ([float(i) for i in range(21)], (1.0, 19.0)),          # k = 3: (0+1+2)/3, (18+19+20)/3
    ([1.0, 3.0], (1.0, 3.0)),
])
def test_edge_means_by_hand(values, expected):
    assert edge_means(values) == expected


def test_edge_means_other_fraction():
    # fraction 0.5 of 5 values: k = ceil(2.5) = 3 -> (1+2+3)/3 and (3+4+5)/3
    assert edge_means([1.0, 2.0, 3.0, 4.0, 5.0], fraction=0.5) == (2.0, 4.0)


def test_edge_means_of_nothing_raises():
    with pytest.raises(ValueError):
        edge_means([])


async def test_an_unusable_output_dir_is_a_config_error_naming_the_flag(tmp_path):
    from replayrl.tools.run.launcher import launch

    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ConfigError, match=f"--output-dir {afile}: not writable"):
        await launch(build_config({"output-dir": str(afile), "num-steps": 1, "progress": False}))


def test_learning_rate_defaults_to_ten_times_for_lora_and_keeps_a_given_one():
    assert build_config({}).trainer.lr == 3e-4
    assert build_config({"lora-rank": 8}).trainer.lr == 1e-3
    assert build_config({"lora-rank": 8, "lr": 1e-3}).trainer.lr == 1e-3
    assert parse("--lr", "0").trainer.lr == 3e-4  # 0 asks for the default by name
    # the resolved rate is what a saved config holds: a resumed LoRA run keeps 3e-3
    from replayrl.trainer.config import TrainerConfig

    assert TrainerConfig(**build_config({"lora-rank": 8}).trainer.to_dict()).lr == 1e-3
