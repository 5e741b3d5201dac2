"""Children started by replayrl.actors.child_process (the actors' and the initial-files child's
start): each behaves as multiprocessing's spawn children did where the Supervisor looks (exit
codes, signals, the sentinel), a call's result and error come back, the parent's sys.path
reaches the child, and no resource-tracker process is started beside the parent."""
from __future__ import annotations

import os
import pickle
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from replayrl.actors.child_process import live_children, run_in_child, start_child
from replayrl.actors.errors import ActorDied, RemoteError
from tests.child_env import PYTHONPATH


def _pid_and_sum(a: int, b: int) -> tuple[int, int]:
    return os.getpid(), a + b


def _raise_value_error(text: str) -> None:
    raise ValueError(text)


def _exit_with(code: int) -> None:
    os._exit(code)


class _Unpicklable(Exception):
    def __init__(self, lock):
        super().__init__("holds a lock")
        self.lock = lock


def _raise_unpicklable() -> None:
    import threading

    raise _Unpicklable(threading.Lock())


def test_a_call_runs_in_another_process_and_returns():
    pid, total = run_in_child(_pid_and_sum, 2, 40)
    assert total == 42 and pid != os.getpid()


def test_a_call_raises_its_own_exception_here():
    with pytest.raises(ValueError, match="bad row 7"):
        run_in_child(_raise_value_error, "bad row 7")


def test_a_child_that_dies_without_answering_is_named_with_its_code():
    with pytest.raises(ActorDied, match="_exit_with") as died:
        run_in_child(_exit_with, 3)
    assert died.value.exitcode == 3


def _die_of_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # no KeyboardInterrupt to answer with: death
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)


def test_a_child_killed_by_ctrl_c_before_it_answers_is_an_interrupt_here():
    """Ctrl-C reaches the process group: a child still importing dies of SIGINT (exit code -2)
    without answering, which the launcher must report as the interrupt it is (exit 130), not as
    a dead actor (exit 1)."""
    with pytest.raises(KeyboardInterrupt, match="child process of _die_of_sigint interrupted"):
        run_in_child(_die_of_sigint)


def test_an_exception_that_does_not_pickle_comes_back_as_its_text():
    with pytest.raises(RemoteError, match="_Unpicklable: holds a lock") as raised:
        run_in_child(_raise_unpicklable)
    assert raised.value.remote_type == "_Unpicklable" and "_raise_unpicklable" in raised.value.remote_traceback


def _imported_from(name: str) -> str:
    import importlib

    return importlib.import_module(name).__file__


def test_modules_in_the_working_directory_do_not_shadow_the_childs(tmp_path, monkeypatch):
    # multiprocessing's spawn child did not see them either (`python -c` puts the directory first)
    for name in ("secrets", "json", "asyncio"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('shadowed')\n")
    monkeypatch.chdir(tmp_path)
    assert run_in_child(_imported_from, "secrets") == _imported_from("secrets")
    assert run_in_child(_pid_and_sum, 1, 2)[1] == 3


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_descriptor_is_left_open():
    before = _open_fds()
    for _ in range(3):
        with pytest.raises(ValueError):
            run_in_child(_raise_value_error, "x")
        with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
            run_in_child(_pid_and_sum, threading.Lock(), 1)  # does not pickle: nothing starts
        run_in_child(_pid_and_sum, 1, 2)
    assert _open_fds() == before


def test_exit_codes_signals_and_the_sentinel():
    child = start_child(time.sleep, (60,), name="sleeper")
    try:
        assert child.exitcode is None and child.is_alive() and child in live_children()
        start = time.monotonic()
        child.join(0.2)  # returns with it still running
        assert time.monotonic() - start < 5 and child.exitcode is None
        assert select.select([child.sentinel], [], [], 0)[0] == []  # not readable while it runs
        child.kill()
        assert select.select([child.sentinel], [], [], 10)[0] == [child.sentinel]
        child.join(10)
        assert child.exitcode == -signal.SIGKILL and child not in live_children()
    finally:
        child.kill()
    done = start_child(_exit_with, (5,))
    done.join(30)
    assert done.exitcode == 5


def test_the_parents_sys_path_reaches_the_child(tmp_path, monkeypatch):
    (tmp_path / "only_here.py").write_text("import os\n\ndef where():\n    return os.getpid(), __file__\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_here

    pid, file = run_in_child(only_here.where)
    assert pid != os.getpid() and file == str(tmp_path / "only_here.py")


FRESH = textwrap.dedent("""
    import os, sys, time
    from replayrl.actors.child_process import start_child
    child = start_child(time.sleep, (0.1,))
    child.join(30)
    kids = [p for p in os.listdir("/proc") if p.isdigit()
            and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
    print(child.exitcode, len(kids), "multiprocessing.resource_tracker" in sys.modules)
""")


def test_no_resource_tracker_beside_the_parent():
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert out.returncode == 0, out.stderr
    # the child exited 0 and was reaped; no other child (multiprocessing's tracker) lives
    assert out.stdout.split() == ["0", "0", "False"]
