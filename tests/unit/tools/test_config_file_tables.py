"""``--config FILE`` with tables (tools/run/config_file.py): ``[rollout]`` / ``[trainer]`` hold
that side's flags or field names and give the same run as the flat file; any other table, and
a flag in the other side's table, is refused naming the file and the table."""
from __future__ import annotations

import argparse
import json

import pytest

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config, config_from_args

FLAT = """
num-steps = 7
rollout_batch_size = 4
rollout-max-response-len = 5
seed = 3
lr = 0.01
use_routing_replay = false
"""

TABLES = """
num-steps = 7
seed = 3

[rollout]
rollout-batch-size = 4
max_response_len = 5      # a field name, as a run's config.json writes it

[trainer]
lr = 0.01
use-routing-replay = false
"""


def _read(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return config_from_args(argparse.Namespace(config=path))


def test_a_toml_with_tables_reads_as_the_flat_file(tmp_path):
    flat = _read(tmp_path, "flat.toml", FLAT)
    tables = _read(tmp_path, "tables.toml", TABLES)
    assert tables.to_dict() == flat.to_dict()
    assert (tables.num_steps, tables.rollout.rollout_batch_size, tables.rollout.max_response_len) == (7, 4, 5)
    assert (tables.trainer.lr, tables.trainer.use_routing_replay) == (0.01, False)
    assert tables.rollout.seed == tables.trainer.seed == 3
    assert tables.to_dict() != build_config({}).to_dict()  # the file was read, not ignored


def test_a_runs_record_reads_back_as_that_run(tmp_path):
    config = build_config({"num-steps": 9, "rollout-batch-size": 4, "lr": 0.02})
    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    assert config_from_args(argparse.Namespace(config=path)).to_dict() == config.to_dict()


@pytest.mark.parametrize("name, text, table", [
    ("run.toml", "[run]\nnum-steps = 7\n", "[run]"),
    ("model.toml", "num-steps = 7\n[model]\nhf-checkpoint = 'x'\n", "[model]"),
    ("run.json", json.dumps({"run": {"num-steps": 7}}), "object 'run'"),
])
def test_another_table_is_refused_naming_the_file_the_table_and_the_layout(tmp_path, name, text, table):
    with pytest.raises(ConfigError) as info:
        _read(tmp_path, name, text)
    message = str(info.value)
    for part in (str(tmp_path / name), table, "flags at the top level", "[rollout] / [trainer]"):
        assert part in message, part


@pytest.mark.parametrize("text, match", [
    ("[rollout]\nlr = 0.01\n", r"\[rollout\] sets 'lr', a trainer flag \(--lr\): put it in \[trainer\]"),
    ("[trainer]\nnum-steps = 3\n", r"\[trainer\] sets 'num-steps', a run-level flag .*top level"),
    ("[trainer]\nlrr = 3\n", r"unknown key 'lrr' in \[trainer\]"),
    ("[rollout]\nmax_response_len = 5\nrollout-max-response-len = 6\n",
     r"--rollout-max-response-len is given twice in \[rollout\]"),
    ("seed = 1\n[rollout]\nseed = 2\n", "--seed is given twice with different values"),
    ("num_steps = 3\nnum-steps = 3\n", r"--num-steps is given twice \(as dashes and underscores\)"),
])
def test_a_setting_in_the_wrong_place_or_twice_is_refused(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        _read(tmp_path, "bad.toml", text)
