"""One mapping from how a command ends to its exit code (tools/run/exit_codes.py)."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from replayrl.tools.errors import ConfigError, Terminated
from replayrl.tools.run.exit_codes import _on_sigterm, exit_code, handle_sigterm, until_terminated


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


def test_sigterm_during_the_loop_cancels_the_run_not_the_task_that_happened_to_run():
    # the handler alone raises Terminated in whatever frame runs, often an actor's task served
    # beside the run, which then ends with an unretrieved exception (logged as an ERROR) while
    # the run goes on; until_terminated cancels the run itself and raises Terminated after its
    # clean-up, and leaves the installed handler as it was
    ended: list[str] = []

    async def actor_task() -> None:
        while True:  # busy between awaits, as an actor computing
            await asyncio.sleep(0)

    async def run() -> None:
        other = asyncio.ensure_future(actor_task())
        try:
            await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(30)
            ended.append("not cancelled")
        finally:
            ended.append("cleaned up")
            assert not other.done()  # the signal went to the run, not to the task beside it
            other.cancel()

    before = signal.getsignal(signal.SIGTERM)
    handle_sigterm()
    try:
        with pytest.raises(Terminated):
            asyncio.run(until_terminated(run()))
        assert ended == ["cleaned up"]
        assert signal.getsignal(signal.SIGTERM) is _on_sigterm
    finally:
        signal.signal(signal.SIGTERM, before)


def test_until_terminated_passes_results_and_errors_through():
    async def value() -> int:
        return 7

    async def fails() -> None:
        raise ConfigError("bad")

    assert asyncio.run(until_terminated(value())) == 7
    with pytest.raises(ConfigError):
        asyncio.run(until_terminated(fails()))
