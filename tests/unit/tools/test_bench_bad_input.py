"""Every ``replayrl bench NAME`` answers bad input as ``replayrl train`` does: one line on
stderr, exit code 2, no traceback (tools/bench/usage.py's parser; the values a benchmark
cannot run with are refused by the parser, before any work)."""
from __future__ import annotations

import pytest

from replayrl.tools import cli
from replayrl.tools.bench.usage import train_refusal
from replayrl.tools.cli import BENCHES


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", *argv])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    return lines[0]


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_an_unknown_flag_is_one_line_naming_it(name, capsys):
    assert _refused([name, "--no-such-flag"], capsys) == (
        f"replayrl bench {name}: error: unrecognized arguments: --no-such-flag "
        f"(`replayrl bench {name} --help` describes the flags)")


@pytest.mark.parametrize("argv, reason", [
    (["parity", "--hf-checkpoint", "MISSING"],
     "--hf-checkpoint MISSING: cannot read MISSING/config.json: [Errno 2] No such file or "
     "directory: 'MISSING/config.json'"),
    (["parity", "--train-backend", "megatron"], "--train-backend megatron needs --hf-checkpoint DIR"),
    (["lora", "--rank", "0"], "argument --rank: must be >= 1, got 0"),
    (["transport", "--calls", "0"], "argument --calls: must be >= 1, got 0"),
    (["load", "--hidden", "0"], "argument --hidden: must be >= 1, got 0"),
    (["traces", "--positions", "0"], "argument --positions: must be >= 1, got 0"),
    (["traces", "--window", "x"], "argument --window: expected int, got 'x'"),
    (["engine", "--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_a_missing_path_or_a_bad_value_is_one_line_naming_the_flag(argv, reason, tmp_path,
                                                                   monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # MISSING is missing here
    assert _refused(argv, capsys) == (f"replayrl bench {argv[0]}: error: {reason} "
                                      f"(`replayrl bench {argv[0]} --help` describes the flags)")


def test_a_refused_train_child_becomes_the_benchmarks_own_one_line_refusal():
    output = "some warning\nreplayrl: configuration error: MISSING: no such prompt file\n"
    refused = train_refusal(2, output)
    assert str(refused) == "replayrl train refused the flags: MISSING: no such prompt file"
    assert train_refusal(1, output) is None and train_refusal(0, "") is None
