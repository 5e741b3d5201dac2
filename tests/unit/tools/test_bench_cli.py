"""``replayrl bench``: the benchmark list (alone and with ``--help``), and every benchmark's
``--help``: its usage line names the command a user typed."""
from __future__ import annotations

import importlib
import re

import pytest

from replayrl.tools import cli
from replayrl.tools.bench.usage import bench_parser, summary
from replayrl.tools.cli import BENCHES

# what a newcomer should read beside a few names (the first paragraphs of their docstrings)
LISTED = {
    "parity": "How far the trainer's logprobs are from the engine's, per replay.",
    "decode": "What hostile 1 MiB headers cost the codec's decoder, against plain msgpack.",
    "faults": "What each fault costs a real run, as a table.",
}


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_help_shows_the_replayrl_command(name, capsys):
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(BENCHES[name]).main(["--help"])
    assert exited.value.code == 0
    # argparse's default prog is the script's file name: 'cli.py' under the console script
    assert capsys.readouterr().out.startswith(f"usage: replayrl bench {name} ")


def _options(help_text: str) -> dict[str, str]:
    """``{option: its help joined on one line}`` of an argparse ``--help`` text's options."""
    body = help_text.split("\noptions:\n", 1)[1]
    options: dict[str, str] = {}
    name = None
    for line in body.splitlines():
        if line.startswith("  -"):
            name, _, text = line.strip().partition("  ")
            options[name] = text.strip()
        elif line.startswith("   ") and name:
            options[name] = (options[name] + " " + line.strip()).strip()
        else:
            name = None
    return options


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_option_says_what_it_sets_and_its_default(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per option: argparse wraps at the terminal
    with pytest.raises(SystemExit):
        importlib.import_module(BENCHES[name]).main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert description.endswith(".") and description.count("(") == description.count(")"), description
    for option, text in _options(out).items():
        if option.startswith("-h,"):
            continue
        # said in words, then its default; no text cut off inside a parenthesis
        assert re.match(r"[a-zA-Z]", text) and text.count("(") == text.count(")"), (option, text)
        assert "(default:" in text or "(default " in text, (option, text)


def test_the_help_formatter_shows_each_kind_of_default_once(capsys):
    parser = bench_parser("x", "``replayrl bench x``: what x is for.\n\nMore.")
    parser.add_argument("--n", type=int, default=3, help="how many")
    parser.add_argument("--names", nargs="+", default=["a", "b"], help="which")
    parser.add_argument("--fast", action="store_true", help="go fast")
    parser.add_argument("--said", default=5, help="already said (default: five)")
    parser.add_argument("--empty", default="", help="what leaving it out does is the text's job")
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    options = _options(capsys.readouterr().out)
    assert options["--n N"] == "how many (default: 3)"
    assert options["--names NAMES [NAMES ...]"] == "which (default: a b)"
    assert options["--fast"] == "go fast (default: off)"
    assert options["--said SAID"] == "already said (default: five)"
    assert options["--empty EMPTY"] == "what leaving it out does is the text's job"


def _listed(out: str) -> dict[str, str]:
    """``{name: description}`` of the ``benchmarks:`` block of ``out`` (continuation lines
    joined)."""
    entries: dict[str, str] = {}
    name = None
    for line in out.split("benchmarks:\n", 1)[1].splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name, _, text = line.strip().partition(" ")
            entries[name] = text.strip()
        elif line.strip() and name:
            entries[name] += " " + line.strip()
    return entries


def test_bench_alone_lists_every_benchmark_with_a_description(capsys):
    assert cli.main(["bench"]) == 0
    listed = _listed(capsys.readouterr().out)
    assert sorted(listed) == sorted(BENCHES)
    for name, text in LISTED.items():
        assert listed[name] == text
    assert all(len(text) > 20 and text.endswith(".") for text in listed.values()), listed


def test_bench_help_lists_them_too(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: replayrl bench ")
    assert sorted(_listed(out)) == sorted(BENCHES)


@pytest.mark.parametrize("doc, expected", [
    ("``replayrl bench x``: how fast x is, per step.\n\nMore.", "How fast x is, per step."),
    ("Benchmark: bytes per token against\nint32 (not a test; see docs).\n\nMore.",
     "Bytes per token against int32."),
    ("``replayrl bench peer``: replayrl against ``TRL``, same budget", "replayrl against TRL, same budget."),
])
def test_summary_is_the_first_paragraph_on_one_line(doc, expected):
    assert summary(doc) == expected
