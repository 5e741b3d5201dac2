"""One mapping from how a command ends to its exit code (tools/run/exit_codes.py)."""
from __future__ import annotations

import pytest

from replayrl.tools.errors import ConfigError, Terminated
from replayrl.tools.run.exit_codes import exit_code


def _raises(exc: BaseException):
    def body():
        raise exc
    return body


@pytest.mark.parametrize("body, code, line", [
    (lambda: 0, 0, ""),
    (lambda: None, 0, ""),
    (lambda: 5, 5, ""),  # exit(5) in the REPL console
    (_raises(ConfigError("--lr must be > 0")), 2, "replayrl: configuration error: --lr must be > 0\n"),
    (_raises(KeyboardInterrupt()), 130, "replayrl: interrupted; all actors stopped\n"),
    (_raises(Terminated()), 143, "replayrl: terminated; all actors stopped\n"),
    (_raises(RuntimeError("boom")), 1, "replayrl: run failed: RuntimeError: boom\n"),
])
def test_each_ending_has_its_code_and_one_line(capsys, body, code, line):
    assert exit_code(body) == code
    assert capsys.readouterr().err == line


def test_prefix_and_failure_wording(capsys):
    assert exit_code(_raises(ValueError("x")), prog="replayrl[rank 2]", failure="actors failed to start") == 1
    assert capsys.readouterr().err == "replayrl[rank 2]: actors failed to start: ValueError: x\n"


def test_exceptions_outside_failures_propagate_but_ctrl_c_and_config_do_not():
    with pytest.raises(RuntimeError):
        exit_code(_raises(RuntimeError("bench bug")), failures=())
    assert exit_code(_raises(KeyboardInterrupt()), failures=()) == 130
    assert exit_code(_raises(ConfigError("bad")), failures=()) == 2
