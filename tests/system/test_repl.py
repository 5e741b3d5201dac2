"""The interactive actor REPL: a ReplSession on real actor processes, and ``replayrl repl``."""
from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from replayrl.actors import ActorCallError, ActorDied, ActorSpec, ActorTimeout, RemoteError, UnknownActor
from replayrl.tools.console.repl import ConsoleProxy, ReplSession
from replayrl.tools.errors import ReplError, SessionClosed
from replayrl.tools.run.from_flags import build_config
from tests.child_env import PYTHONPATH
from tests.paths import REPO

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


def test_repl_command_reads_stdin_and_stops_every_actor(tmp_path, ipc_tmp):
    tmp = ipc_tmp
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": PYTHONPATH}
    script = "\n".join([
        "print('CLOCK', version_clock.state())",
        "print('PIDS', sorted(a.__ping__()['pid'] for a in actors.values()))",
        "trainer.trian()",  # a typo: one line, no traceback; the console goes on
        "print('STILL', trainer.state()['version'])",
        "exit()",
    ]) + "\n"
    proc = subprocess.run(
        [sys.executable, "-m", "replayrl.tools.cli", "repl", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--num-steps", "1", "--no-progress",
         "--output-dir", str(tmp_path / "out")],
        cwd=REPO, env=env, input=script, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the console writes its prompts (">>> ") to stdout in front of each printed line
    lines = dict(re.findall(r"(CLOCK|PIDS|STILL) (.*)", proc.stdout))
    assert ast.literal_eval(lines["CLOCK"]) == {"max_staleness": 1, "trainer_version": 0,
                                                "engine_versions": {}}
    pids = ast.literal_eval(lines["PIDS"])
    # the clock and the manager share one process (ActorSpec.process DRIVER), engine, trainer
    assert len(pids) == 4 and len(set(pids)) == 3
    assert lines["STILL"] == "0"
    # the refused call as one line naming the actor, the method and the close match
    assert ("\nActorCallError: actor 'trainer' (TrainerActor) has no method 'trian'; did you "
            "mean 'train'?\n") in proc.stderr.replace(">>> ", "\n")
    assert "Traceback" not in proc.stderr
    assert not [p for p in pids if _alive(p)]
    assert [p for p in tmp.iterdir() if p.name.startswith("replayrl-")] == []  # ipc dir gone


def test_a_refused_call_prints_one_line_and_other_errors_their_traceback(capsys):
    from replayrl.tools.console.prompt import Console

    def typo():
        raise ActorCallError("actor 'trainer' (TrainerActor) has no method 'trian'; did you mean 'train'?")

    console = Console({"typo": typo, "boom": lambda: 1 / 0})
    console.push("typo()")
    assert capsys.readouterr().err == ("ActorCallError: actor 'trainer' (TrainerActor) has no "
                                       "method 'trian'; did you mean 'train'?\n")
    console.push("boom()")
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("ZeroDivisionError: division by zero\n")


def test_an_unknown_actor_or_metrics_key_prints_one_line(capsys):
    from replayrl.tools.console.prompt import Console
    from replayrl.tools.console.views import metrics_text

    def methods(name):  # what Directory.proxy raises for a name the run does not have
        raise UnknownActor(f"no actor named {name!r}; known: ['clock', 'trainer']")

    rows = [{"step": 1, "reward_mean": 0.5}]
    console = Console({"methods": methods, "metrics": lambda keys: metrics_text(rows, keys)})
    console.push("methods('nosuch')")
    # the message itself, not the KeyError repr (quoted) and no traceback
    assert capsys.readouterr().err == ("UnknownActor: no actor named 'nosuch'; "
                                       "known: ['clock', 'trainer']\n")
    console.push("metrics(['reward_maen'])")
    assert capsys.readouterr().err == ("MetricKeyError: no metrics row of the last 1 has key(s) "
                                       "'reward_maen'; 'reward_maen': did you mean "
                                       "'reward_mean'?\n")


def test_metrics_keeps_the_step_column_whatever_keys_are_asked():
    from replayrl.tools.console.views import metrics_text

    rows = [{"step": 3, "reward_mean": 0.25, "samples": 4}, {"step": 4, "reward_mean": 0.5}]
    assert metrics_text(rows, ["reward_mean", "samples"]).splitlines() == [
        "step  reward_mean  samples",
        "   3         0.25        4",
        "   4          0.5        -"]
    # asked for explicitly (anywhere), it stays one column, the first
    assert metrics_text(rows, ["reward_mean", "step"]).splitlines()[0] == "step  reward_mean"


def test_metrics_takes_one_key_as_a_string_and_refuses_keys_no_row_has():
    from replayrl.tools.console.views import metrics_text
    from replayrl.tools.errors import MetricKeyError

    rows = [{"step": 3, "reward_mean": 0.25, "samples": 4}, {"step": 4, "reward_mean": 0.5}]
    # one key, not one column per letter
    assert metrics_text(rows, "reward_mean").splitlines() == [
        "step  reward_mean", "   3         0.25", "   4          0.5"]
    # a key in some rows only is shown ('-' elsewhere); one in none is refused, naming it
    with pytest.raises(MetricKeyError, match=r"'rewrd_mean': did you mean 'reward_mean'\?"):
        metrics_text(rows, ["samples", "rewrd_mean"])
    with pytest.raises(MetricKeyError) as refused:
        metrics_text(rows, ["nonexistent"])
    assert str(refused.value) == ("no metrics row of the last 2 has key(s) 'nonexistent'; "
                                  "the rows' keys: reward_mean, samples, step")
    # the default columns are shown whether or not the rows have them
    assert metrics_text(rows).splitlines()[0].split() == [
        "step", "trainer_version", "reward_mean", "staleness_max", "samples",
        "response_len_mean", "step_seconds"]


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _plain(text: str) -> str:
    """Terminal output without escape sequences and with whitespace runs made single spaces."""
    return " ".join(_ANSI.sub("", text).split())


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 240.0) -> None:
    """Bounded wait for ``path`` to appear while ``proc`` lives (not a timing assertion)."""
    import time

    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, f"the run ended early: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"{path} did not appear within {seconds} s"
        time.sleep(0.1)


def test_attach_through_a_terminal_pauses_resumes_and_detaches_without_disturbing_the_run(tmp_path, ipc_tmp):
    """A user at a terminal attaches to a live ``replayrl train``: lists methods with their
    docstrings (Tab-completes one), sees the clock, metrics and a sample's traces, pauses
    generation, and detaches while paused; the run then finishes every step with exact versions."""
    pexpect = pytest.importorskip("pexpect")
    from replayrl.rollout.dispatch.manager import RolloutManager
    from tests.hook_fixtures import HOLD_ENV

    tmp, out, release = ipc_tmp, tmp_path / "out", tmp_path / "release"
    second = tmp_path / "release.second"  # hold_after_steps_0_and_1's second release
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": PYTHONPATH, HOLD_ENV: str(release),
           "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}
    steps = 3  # step 1 trains while rollout 2 waits at the paused gate; step 2 after detaching
    run = subprocess.Popen(
        [sys.executable, "-m", "replayrl.tools.cli", "train", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--num-steps", str(steps), "--no-progress",
         "--output-dir", str(out), "--metrics-hook", "tests.hook_fixtures:hold_after_steps_0_and_1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    repl = None
    try:
        _wait_for(out / "attach.json", run)
        endpoints = json.loads((out / "attach.json").read_text())["endpoints"]
        config = build_config({**TINY, "num-steps": steps})

        # attached by one actor's address: it finds every actor; the metrics are on the
        # driver's host and the help offers no step() (a session in this process: the
        # console's command line is the terminal session's below)
        with ReplSession(config, attach=endpoints["version_clock"]) as by_address:
            assert sorted(by_address.namespace["actors"]) == sorted(endpoints)
            with pytest.raises(ReplError, match="metrics.jsonl is on the driver's host"):
                by_address.namespace["metrics"]()
            assert "step()" not in by_address.namespace["help_text"].replace("steps nothing", "")

        repl = pexpect.spawn(sys.executable, ["-m", "replayrl.tools.cli", "repl", "--attach", str(out)],
                             cwd=str(REPO), env=env, encoding="utf-8", timeout=120,
                             dimensions=(50, 200))
        # a new prompt turns bracketed paste on (prompt_toolkit); the line just typed is
        # redrawn with "replayrl>" in front of it, so the prompt text alone is no marker
        prompt = re.escape("\x1b[?2004h")

        marks = iter(range(1_000))

        def enter(line: str) -> str:
            """Type one simple statement and return what it printed, up to a marker printed
            after it (spelt so that the echoed input holds no copy of it): a prompt redrawn early
            on a loaded machine once cut the captured text short."""
            mark = next(marks)
            repl.sendline(f"{line}; print('<<' + 'done{mark}>>')")
            repl.expect(f"<<done{mark}>>")
            text = repl.before
            repl.expect(prompt)
            return text

        def enter_raw(line: str) -> str:  # a compound statement's line, or the empty line after it
            repl.sendline(line)
            repl.expect(prompt)
            return repl.before

        repl.expect(prompt)
        clock = ast.literal_eval(re.search(r"CLOCK= (\{.*\})", enter("print('CLOCK=', clock())")).group(1))
        # held after step 0: the trainer is at version 1, nothing is paused
        assert clock["trainer_version"] == 1 and clock["max_staleness"] == 1
        assert clock["generation"] == {"paused": False, "in_flight": 0, "held": 0}

        listing = _plain(enter("methods('rollout_manager')"))
        assert "rollout_manager (RolloutManager)" in listing
        doc = inspect.getdoc(RolloutManager.pause_generation).split("\n\n")[0]
        assert "pause_generation(wait: bool = True) -> dict " + " ".join(doc.split()) in listing
        assert "last_sample() -> dict" in listing and "take_batch(rollout_id: int) -> dict" in listing

        repl.send("rollout_manager.pause_gen\t")  # Tab asks the actor for its methods
        repl.expect(r"eration\(")  # the completion is drawn after the typed "pause_gen"
        repl.send("\x7f\r")  # drop the "(": show the method instead of calling it
        repl.expect(prompt)
        shown = _plain(repl.before)
        assert ("rollout_manager.pause_generation(wait: bool = True) -> dict "
                + " ".join(inspect.getdoc(RolloutManager.pause_generation).split())) in shown

        paused = ast.literal_eval(re.search(r"P= (\{.*\})", enter("print('P=', pause())")).group(1))
        assert paused == {"paused": True, "in_flight": 0, "held": 0}
        release.touch()  # the driver goes on: step 1 trains, rollout 2 waits at the gate
        enter("import time; t0 = time.monotonic()")
        enter_raw("while (lambda c: c['trainer_version'] < 2 or c['generation']['held'] == 0)(clock()) "
                  "and time.monotonic() - t0 < 180: time.sleep(0.1)")
        enter_raw("")  # the empty line that ends the block, as a user types it
        held = ast.literal_eval(re.search(r"HELD= (\{.*\})", enter("print('HELD=', clock())")).group(1))
        # exact versions while paused: step 1 trained (version 2), but the engine still serves
        # version 1: the loop pushes only once the held rollout is generated
        assert held["trainer_version"] == 2 and held["engine_versions"] == {"engine_0": 1}
        assert held["generation"]["paused"] and held["generation"]["held"] >= 1
        rows = re.search(r"ROWS= (\[.*\])", enter("print('ROWS=', [r['step'] for r in metrics().value])"))
        assert ast.literal_eval(rows.group(1)) == [0]  # step 1's row waits for rollout 2
        assert "step trainer_version reward_mean" in _plain(enter("metrics()"))

        text = _plain(enter("s = sample(); s"))
        shape = re.search(r"SHAPE= (.*)", enter(
            "print('SHAPE=', (list(s.value['routed_experts'].shape), "
            "len(s.value['prompt_ids']) + len(s.value['response_ids']) - 1, "
            "int(s.value['policy_version'][0])))"))
        routed, positions, version = ast.literal_eval(shape.group(1))
        model = config.policy_config
        moe_layers = sum(1 for i in range(model.num_hidden_layers)
                         if i not in model.mlp_only_layers and (i + 1) % model.decoder_sparse_step == 0)
        assert routed == [positions, moe_layers, model.num_experts_per_tok]
        assert version == 0  # rollout 1 was generated at version 0, overlapping step 0
        assert f"routed_experts: int32 [{positions}, {moe_layers}, {model.num_experts_per_tok}]" in text
        assert "traces: sample_support, routed_experts, indexer_topk" in text

        resumed = ast.literal_eval(re.search(r"R= (\{.*\})", enter("print('R=', resume())")).group(1))
        assert resumed["paused"] is False
        # the driver holds after step 1 (until `second`): without it the last step could end the
        # run before the pause below reached it (the pause then met a closed connection)
        enter("pause(wait=False)")
        repl.sendeof()  # detach while paused: the console resumes generation on the way out
        repl.expect(pexpect.EOF)
        repl.close()
        assert repl.exitstatus == 0
        assert "generation resumed" in repl.before and "detaching; the run goes on" in repl.before

        second.touch()
        _, err = run.communicate(timeout=240)
        assert run.returncode == 0, err
    finally:
        release.touch()
        second.touch()
        if repl is not None and repl.isalive():
            repl.close(force=True)
        if run.poll() is None:
            run.kill()
            run.wait()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["trainer_version"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["staleness_max"] <= 1 for r in rows)
    assert not (out / "attach.json").exists()
    assert [p for p in tmp.iterdir() if p.name.startswith("replayrl-")] == []


def test_attach_to_no_run_fails_clearly(tmp_path):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run([sys.executable, "-m", "replayrl.tools.cli", "repl", "--attach", str(tmp_path)],
                          cwd=REPO, env=env, input="", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"--attach {tmp_path}: no attach.json: no run is live there" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "replayrl.tools.cli", "repl", "--attach",
                           "tcp://127.0.0.1:1"], cwd=REPO, env=env, input="",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "a tcp run needs its CURVE keys" in proc.stderr


def test_a_console_that_stops_the_rollout_manager_ends_the_run_naming_it(tmp_path, ipc_tmp):
    """The launcher serves the clock and the manager in its own event loop: one stopped from an
    attached console ends the run at once, failed and naming it (not at the next call's
    timeout, nor as a completed run once both are stopped)."""

    from replayrl.actors.loop import run_event_loop
    from replayrl.tools.run.attach_card import resolve_attach

    out = tmp_path / "out"
    env = {**os.environ, "TMPDIR": str(ipc_tmp), "PYTHONPATH": PYTHONPATH}
    run = subprocess.Popen(
        [sys.executable, "-m", "replayrl.tools.cli", "train", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--num-steps", "100000", "--no-progress",
         "--output-dir", str(out)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(out / "attach.json", run)

        async def stop_manager():
            target = await resolve_attach(str(out))
            await target.directory.ref("rollout_manager").call("__stop__", "console says stop",
                                                                 timeout=10)

        run_event_loop(stop_manager())
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode != 0
    assert "actor 'rollout_manager' stopped serving" in err and "console says stop" in err, err[-2000:]
    assert [p for p in ipc_tmp.iterdir() if p.name.startswith("replayrl-")] == []
