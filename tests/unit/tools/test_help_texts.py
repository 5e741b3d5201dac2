"""Every run flag's help text (``replayrl train --help``, docs/configuration.md) reads as a
whole phrase: it starts with a word, leaves no parenthesis open and does not stop on a word that
needs another after it ("also the refill quantum's)", "a family of the")."""
from __future__ import annotations

import re

import pytest

from replayrl.tools.run.flags import FLAGS

DANGLING = {"a", "an", "the", "of", "to", "and", "or", "with", "for", "in", "on", "by", "as",
            "per", "than", "at", "from", "its", "their"}


def cut_off(text: str) -> str | None:
    """Why ``text`` reads as cut off, or None."""
    if not re.match(r"[A-Za-z-]", text):
        return "does not start with a word"
    if text.count("(") != text.count(")"):
        return "a parenthesis left open"
    for clause in re.split(r"[);]", text):  # the end of every parenthesis and clause
        words = clause.split()
        if words and (words[-1].lower() in DANGLING or words[-1].endswith("'s")):
            return f"stops on {words[-1]!r}"
    return None


@pytest.mark.parametrize("text, why", [
    ("data-parallel ranks (each trains a share; also the refill quantum's)", "stops on \"quantum's\""),
    ("initial policy, or a family of", "stops on 'of'"),
    ("engine precision (bf16 where", "a parenthesis left open"),
    ("(default) nothing", "does not start with a word"),
    ("seconds an engine may take to start (vLLM: import and start-up)", None),
])
def test_cut_off_reads_as_a_reader_would(text, why):
    assert cut_off(text) == why


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_the_flag_help_is_a_whole_phrase(name):
    text = FLAGS[name].setting.help
    assert text, f"--{name} has no help text"
    assert cut_off(text) is None, f"--{name}: {cut_off(text)}: {text}"


def test_hf_checkpoint_help_names_every_family():
    # the families registered today, written out by hand: the help must follow the registry
    help_text = FLAGS["hf-checkpoint"].setting.help
    for model_type in ("qwen3", "qwen3_moe", "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "gpt_oss"):
        assert model_type in help_text
