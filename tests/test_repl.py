"""The interactive actor REPL: a ReplSession on real actor processes, and ``replayrl repl``."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from actors import ActorCallError, ActorDied, ActorSpec, ActorTimeout, RemoteError, UnknownActor
from tools.config import build_config
from tools.repl import ConsoleProxy, ReplSession, SessionClosed

REPO = Path(__file__).resolve().parents[1]
TINY = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "num-steps": 1, "progress": False}


def _children(pid: int) -> set[int]:
    """Live (non-zombie) processes whose parent is ``pid``, read from /proc.

    multiprocessing's resource tracker is left out: the first ``spawn`` of a process starts it
    once and it lives as long as that process, whoever spawned.
    """
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if (int(fields[1]) == pid and fields[0] != "Z"
                    and b"multiprocessing.resource_tracker" not in cmdline):
                kids.add(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_session_drives_the_run_and_leaves_no_process(tmp_path):
    config = build_config({**TINY, "output-dir": str(tmp_path / "out")})
    before = _children(os.getpid())
    with ReplSession(config) as session:
        ns = session.namespace
        assert sorted(ns["actors"]) == ["engine_0", "rollout_manager", "trainer", "version_clock"]
        for name in ns["actors"]:
            assert isinstance(ns[name], ConsoleProxy) and ns[name] is ns["actors"][name]
        assert "step(k)" in ns["help_text"] and ns["config"] is config
        assert (tmp_path / "out" / "checkpoint-init").is_dir()
        processes = session.processes
        run_dir = session.run_dir
        # one process per actor, each answering from its own pid
        pids = {name: ns[name].__ping__()["pid"] for name in ns["actors"]}
        assert pids == {name: p.pid for name, p in processes.items()}

        clock = ns["version_clock"].state()
        assert clock["trainer_version"] == 0 and clock["engine_versions"] == {}
        assert ns["trainer"].state()["version"] == 0

        push = ns["trainer"].push_weights()
        assert push["version"] == 0 and push["bytes"] > 0
        assert ns["call"]("version_clock", "state")["engine_versions"] == {"engine_0": 0}

        metrics = ns["step"](0)
        assert metrics["step"] == 0 and metrics["rollout_id"] == 0
        assert metrics["trainer_version"] == 1
        assert metrics["samples"] == 2 * 2  # rollout-batch-size x n-samples-per-prompt
        assert metrics["staleness_max"] == 0  # generated at version 0, trained at version 0
        assert "policy_versions" not in metrics and metrics["weight_push_bytes"] == push["bytes"]
        # the step pushed version 1 to the engine and the clock recorded both
        assert ns["version_clock"].state() == {"max_staleness": 1, "trainer_version": 1,
                                               "engine_versions": {"engine_0": 1}}
        assert ns["trainer"].state()["version"] == 1

        with pytest.raises(ActorCallError, match="actor 'trainer' \\(TrainerActor\\) has no method "
                                                 "'no_such_method'; its methods: .*push_weights"):
            ns["trainer"].no_such_method()  # refused in the console, before anything is sent
        with pytest.raises(RemoteError, match="RolloutError"):  # rollout 0 was already taken
            ns["call"]("rollout_manager", "take_batch", 0)
        with pytest.raises(UnknownActor):
            ns["call"]("nobody", "state")

    assert all(p.exitcode is not None for p in processes.values())
    assert not [p for p in pids.values() if _alive(p)]
    assert _children(os.getpid()) <= before
    assert not run_dir.exists()
    with pytest.raises(SessionClosed):
        ns["trainer"].state()


def test_remote_errors_timeouts_and_a_dying_actor_reach_the_console(tmp_path):
    config = build_config({"progress": False, "output-dir": str(tmp_path)})
    specs = [ActorSpec("echo", "tests.actor_fixtures:EchoActor", {"tag": "e"})]
    with ReplSession(config, specs) as session:
        echo, call = session.namespace["echo"], session.namespace["call"]
        assert echo.echo({"a": [1, 2]}) == {"a": [1, 2]}
        assert "fail" in dir(echo) and "record(i: int) -> None" in repr(echo)
        # a misspelt method or a wrong argument list fails in the console, nothing is sent
        with pytest.raises(ActorCallError, match="has no method 'recrod'"):
            echo.recrod(1)
        with pytest.raises(ActorCallError, match=r"echo\.record\(i: int\) -> None: too many"):
            call("echo", "record", 1, 2)
        assert echo.recorded() == []

        with pytest.raises(RemoteError) as info:
            echo.fail("boom from the actor")
        assert info.value.remote_type == "ValueError"
        assert info.value.remote_message == "boom from the actor"
        assert "actor_fixtures.py" in info.value.remote_traceback  # the actor's own frames

        with pytest.raises(ActorTimeout):
            # concurrent on the actor, so the abandoned sleep does not hold up the calls below
            call("echo", "sleep_concurrently", 30, timeout=0.2)

        session.namespace["tell"]("echo", "record", 7)
        assert echo.recorded() == [7]  # ordered after the tell on the same actor

        with pytest.raises(ActorDied) as died:
            echo.crash()  # the process exits: the watch ends the wait, not a timeout
        assert died.value.actor == "echo" and died.value.exitcode == 3
        with pytest.raises(ActorDied):
            echo.echo(1)
        processes = session.processes
    assert all(p.exitcode is not None for p in processes.values())


def test_repl_command_reads_stdin_and_stops_every_actor(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    script = "\n".join([
        "print('CLOCK', version_clock.state())",
        "print('PIDS', sorted(a.__ping__()['pid'] for a in actors.values()))",
        "trainer.no_such_method()",  # the error is shown, the console goes on
        "print('STILL', trainer.state()['version'])",
        "exit()",
    ]) + "\n"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "repl", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--num-steps", "1", "--no-progress",
         "--output-dir", str(tmp_path / "out")],
        cwd=REPO, env=env, input=script, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the console writes its prompts (">>> ") to stdout in front of each printed line
    lines = dict(re.findall(r"(CLOCK|PIDS|STILL) (.*)", proc.stdout))
    assert ast.literal_eval(lines["CLOCK"]) == {"max_staleness": 1, "trainer_version": 0,
                                                "engine_versions": {}}
    pids = ast.literal_eval(lines["PIDS"])
    assert len(set(pids)) == 4  # clock, engine, manager, trainer
    assert lines["STILL"] == "0"
    assert "has no method 'no_such_method'" in proc.stderr
    assert not [p for p in pids if _alive(p)]
    assert [p for p in tmp.iterdir() if p.name.startswith("replayrl-")] == []  # ipc dir gone
