"""Settings fields (actors/settings.py) and what tools/run/flags.py generates from them."""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from replayrl.actors.settings import POSITIVE, Choices, Range, Rule, check_settings, setting, settings_of, show_value
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.flags import FLAGS, add_run_flags
from replayrl.tools.run.from_flags import build_config, config_from_args


class Bad(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Toy:
    count: int = setting(1, "count", "how many", Range(low=1))
    ratio: float = setting(0.5, "ratio", "a fraction", Range(0, 1, "(]", why="it is a fraction"))
    k: int = setting(3, "k", "top-k", Range(low=1, also=(-1,), also_text="-1 (off)"))
    cap: float | None = setting(2.0, "cap", "a cap", Range(low=0, closed="()", also=(None,)))
    mode: str = setting("a", "mode", "a mode", Choices(("a", "b", "c")))
    hook: str = setting("", "hook", "a hook", Rule(lambda v: not v or ":" in v, "module:function"))
    size: int = setting(4, check=Range(low=1))  # no flag: messages name the field
    on: bool = setting(True, "on", "a switch")
    plain: float = 0.25  # not a setting

    def __post_init__(self) -> None:
        check_settings(self, Bad)


@pytest.mark.parametrize("kwargs, message", [
    ({"count": 0}, "--count must be >= 1"),
    ({"ratio": 0.0}, "--ratio must be in (0, 1]: it is a fraction"),
    ({"ratio": 1.5}, "--ratio must be in (0, 1]: it is a fraction"),
    ({"k": 0}, "--k must be -1 (off) or >= 1"),
    ({"k": -2}, "--k must be -1 (off) or >= 1"),
    ({"cap": 0.0}, "--cap must be > 0"),
    ({"mode": "d"}, "--mode must be a, b or c"),
    ({"hook": "nocolon"}, "--hook must be module:function"),
    ({"size": 0}, "size must be >= 1"),
])
def test_check_settings_names_the_flag_and_the_range(kwargs, message):
    with pytest.raises(Bad) as info:
        Toy(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("kwargs", [
    {"count": 1}, {"ratio": 1.0}, {"ratio": 1e-9}, {"k": -1}, {"k": 1}, {"cap": None},
    {"cap": 1e-9}, {"mode": "c"}, {"hook": "m:f"}, {"size": 1},
])
def test_values_at_the_edges_of_the_range_are_accepted(kwargs):
    assert getattr(Toy(**kwargs), next(iter(kwargs))) == next(iter(kwargs.values()))


def test_settings_carry_type_flag_and_help_and_skip_plain_fields():
    by_name = {f.name: s for f, s in settings_of(Toy)}
    assert "plain" not in by_name
    assert (by_name["count"].flag, by_name["count"].help, by_name["count"].type) == ("count", "how many", int)
    assert by_name["cap"].type is float and by_name["on"].type is bool and by_name["size"].flag == ""
    assert Toy().count == 1 and Toy().plain == 0.25


def test_range_descriptions_and_values_by_hand():
    assert POSITIVE.describe() == "> 0"
    assert Range(high=3, closed="[)").describe() == "< 3"
    assert Range(0, 2 ** 32, "[)").describe() == "in [0, 2**32)"
    assert Choices((1,)).describe() == "1"
    assert [show_value(v) for v in (True, False, 1 << 30, 1000, 300.0, float("inf"), "x")] == [
        "on", "off", "2**30", "1000", "300.0", "inf", "'x'"]
    with pytest.raises(ValueError):
        Range()
    with pytest.raises(ValueError):
        Range(0, 1, "[[")
    with pytest.raises(TypeError):
        setting([1], "list-flag", "lists are not flags")


def test_flags_that_set_two_fields_reach_both_sections():
    assert FLAGS["seed"].targets == (("rollout", "seed"), ("trainer", "seed"))
    assert FLAGS["rollout-temperature"].targets == (("rollout", "temperature"), ("trainer", "temperature"))
    assert FLAGS["save"].targets == ((None, "save_dir"),)


def test_every_flag_is_added_to_the_parser_with_its_type():
    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    args = parser.parse_args(["--lr", "0.5", "--no-use-packing", "--metrics-hook", "a:b",
                              "--metrics-hook", "c:d", "--rollout-top-k", "-1"])
    assert vars(args) == {"config": None, "lr": 0.5, "use_packing": False,
                          "metrics_hook": ["a:b", "c:d"], "rollout_top_k": -1}
    options = {o for action in parser._actions for o in action.option_strings}
    assert {f"--{name}" for name in FLAGS} <= options


def test_serve_lists_its_own_flags_and_the_model_flags_only(capsys, tmp_path):
    from replayrl.tools.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    # the options column of the help (help texts may mention other flags)
    shown = {flag for line in capsys.readouterr().out.splitlines()
             for flag in re.findall(r"--[a-z][a-z0-9-]*", line.split("  ")[1] if line.startswith("  -") else "")}
    assert shown == {"--help", "--config", "--host", "--port", "--hf-checkpoint", "--model-indexer",
                     "--no-model-indexer", "--engine-dtype", "--engine-torch-threads"}
    with pytest.raises(SystemExit):  # a training flag is refused, not silently ignored
        build_parser().parse_args(["serve", "--num-steps", "3"])
    assert "unrecognized arguments: --num-steps" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--no-model-indexer", "--engine-dtype", "float32",
                                      "--engine-torch-threads", "2", "--port", "0"])
    config = config_from_args(args)
    assert (config.model_indexer, config.engine_dtype, config.engine_torch_threads) == (False, "float32", 2)
    assert not config.policy_config.indexed_layers
    with pytest.raises(KeyError, match="no-such-flag"):
        add_run_flags(argparse.ArgumentParser(), only=("no-such-flag",))


@pytest.mark.parametrize("command", ["train", "repl", "serve"])
def test_a_default_shown_in_help_names_only_flags_the_command_has(command, capsys):
    from replayrl.tools.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # help lines rejoined
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = {o for a in sub.choices[command]._actions for o in a.option_strings}
    # a default such as "the embedded model from --seed" under a command without --seed
    named = {f for default in re.findall(r"\(default: ([^)]*)\)", text)
             for f in re.findall(r"--[a-z][a-z0-9-]*", default)}
    assert named <= options, f"{command} --help: defaults name {sorted(named - options)}"


@pytest.mark.parametrize("flag", ["lr", "clip-grad", "tis-cap", "eps-clip-high", "rollout-temperature",
                                  "rpc-timeout-seconds", "rollout-timeout-seconds"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_values_are_refused_before_the_run(flag, value):
    # inf passes "> 0" but an inf learning rate or clip only fails inside the first step
    with pytest.raises(ConfigError, match=f"--{flag} must be a finite number"):
        build_config({flag: value, "progress": False})
