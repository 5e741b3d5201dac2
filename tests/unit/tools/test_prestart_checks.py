"""What can be checked before start is checked before start: in one line, exit code 2, naming
the flag and the fix (peft for --lora-rank, a wandb login or WANDB_MODE=offline for
--use-wandb, an --env that would never act, text prompts on the embedded model's tokenizer)."""
from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.extras_check import check_extras, wandb_login_problem
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import check_prompt_data, write_embedded_tokenizer


def _train(argv: list[str], capsys) -> tuple[int, list[str]]:
    from replayrl.tools import cli

    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main(["train", *argv])
    finally:  # `replayrl train` turns SIGTERM into an exception: not for the rest of the session
        signal.signal(signal.SIGTERM, sigterm)
    return code, capsys.readouterr().err.splitlines()


@pytest.fixture
def no_wandb_login(monkeypatch, tmp_path):
    """An environment with no wandb key anywhere (a home of its own)."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_CONFIG_DIR", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("flags, line", [
    (["--lora-rank", "4"], "--lora-rank 4 needs the peft package: pip install 'replayrl[lora]'"),
    (["--use-wandb"], "--use-wandb: no Weights & Biases API key for api.wandb.ai (WANDB_API_KEY, "
                      "`wandb login`'s netrc entry or its settings file); set WANDB_MODE=offline "
                      "to log to <output-dir>/wandb without one (`wandb sync` uploads it later), "
                      "or log in first"),
    (["--env", "digit_calculator"], "--env digit_calculator acts between turns, but "
                                    "--rollout-max-turns 1 leaves none: the environment would "
                                    "never act; give --rollout-max-turns 2 or more (a tool call "
                                    "and its answer take two)"),
    (["--env", "retrieval", "--rollout-max-turns", "3"],
     "--env retrieval offers tools (search) that reach the policy only through the chat "
     "template: add --apply-chat-template (with a tokenizer whose chat template renders tools); "
     "without it the environment never acts"),
])
def test_refused_before_start_in_one_line_with_exit_code_2(flags, line, tmp_path, monkeypatch,
                                                            capsys, no_wandb_login):
    monkeypatch.setitem(sys.modules, "peft", None)  # not importable: find_spec finds nothing
    code, err = _train([*flags, "--output-dir", str(tmp_path / "out")], capsys)
    assert (code, err) == (2, [f"replayrl: configuration error: {line}"])
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_extras_pass_where_they_are_installed_and_logged_in(monkeypatch, no_wandb_login):
    import importlib.util

    if not all(importlib.util.find_spec(p) for p in ("peft", "wandb")):  # found, not imported
        pytest.skip("the lora / wandb extras are not installed")
    check_extras(build_config({"lora-rank": 4, "use-wandb": True}), {"WANDB_MODE": "offline"})


@pytest.mark.parametrize("environ, problem", [
    ({}, True),
    ({"WANDB_MODE": "offline"}, False),
    ({"WANDB_MODE": "disabled"}, False),
    ({"WANDB_MODE": "online"}, True),
    ({"WANDB_API_KEY": "k" * 40}, False),
])
def test_a_wandb_key_from_the_environment_or_offline_mode(environ, problem, tmp_path):
    assert (wandb_login_problem({"HOME": str(tmp_path), **environ}) is not None) == problem


def test_a_wandb_key_from_netrc_for_the_servers_host_or_the_settings_file(tmp_path):
    home = {"HOME": str(tmp_path)}
    (tmp_path / ".netrc").write_text("machine wandb.example.com login user password " + "k" * 40 + "\n")
    assert wandb_login_problem(home) is not None  # a key, but for another server
    assert wandb_login_problem({**home, "WANDB_BASE_URL": "https://wandb.example.com"}) is None
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    assert wandb_login_problem(home) is None
    (tmp_path / ".netrc").unlink()
    settings = tmp_path / ".config" / "wandb" / "settings"
    settings.parent.mkdir(parents=True)
    settings.write_text("[default]\napi_key = " + "k" * 40 + "\n")
    assert wandb_login_problem(home) is None


def test_text_prompts_on_the_embedded_tokenizer_name_the_flag_to_give(tmp_path):
    prompts = tmp_path / "text.jsonl"
    prompts.write_text('{"prompt": "What is two plus two?", "label": "4"}\n')
    config = build_config({"prompt-data": str(prompts), "rm-type": "exact",
                           "output-dir": str(tmp_path / "out")})
    tokenizer = write_embedded_tokenizer(tmp_path / "ckpt")  # what checkpoint-init holds
    with pytest.raises(ConfigError) as info:
        check_prompt_data(config, Path(tokenizer))
    vocab = config.policy_config.vocab_size
    assert str(info.value) == (
        f"--prompt-data {prompts}:1: key 'prompt': not made of the {vocab} words the embedded "
        f"model's tokenizer knows (the digit task's); for text prompts give --hf-checkpoint DIR, a "
        f"policy with its own tokenizer (or --tokenizer DIR whose ids fit the policy's vocabulary "
        f"of {vocab})")


def test_a_response_length_that_fills_the_positions_names_its_flag_not_the_prompts(tmp_path):
    """The embedded policy has 256 positions (its preset, built for the built-in task): a
    256-token eval answer leaves no room for any prompt, which the flag is told, rather than
    every prompt row being refused as too long by a negative margin."""
    rows = tmp_path / "eval.jsonl"
    rows.write_text('{"prompt": "<bos> max 3 1 4 2 =", "label": "4"}\n')
    config = build_config({"eval-prompt-data": ["test", str(rows)], "eval-interval": 10,
                           "eval-max-response-len": 256, "output-dir": str(tmp_path / "out")})
    assert config.policy_config.max_position_embeddings == 256
    with pytest.raises(ConfigError) as info:
        check_prompt_data(config, write_embedded_tokenizer(tmp_path / "ckpt"))
    assert str(info.value) == ("--eval-max-response-len 256 leaves no room for a prompt in the "
                               "policy's 256 positions (max_position_embeddings); give at most "
                               "255, less each prompt's length")


def test_serve_without_its_extra_names_the_extra_with_exit_code_2(monkeypatch, capsys):
    from replayrl.tools import cli

    monkeypatch.setitem(sys.modules, "aiohttp", None)  # not importable: find_spec finds nothing
    assert cli.main(["serve", "--port", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "replayrl: configuration error: replayrl serve needs the aiohttp package: "
        "pip install 'replayrl[serve]'"]


def test_keys_into_a_directory_that_holds_a_pair_is_refused_with_exit_code_2(tmp_path, capsys):
    from replayrl.tools import cli

    assert cli.main(["keys", str(tmp_path / "k")]) == 0
    written = sorted(p.name for p in (tmp_path / "k").iterdir())
    capsys.readouterr()
    assert cli.main(["keys", str(tmp_path / "k")]) == 2  # never overwritten: peers would split
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"replayrl: configuration error: replayrl keys "
                                               f"{tmp_path / 'k'}: ")
    assert "refusing to overwrite" in err[0]
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == written
