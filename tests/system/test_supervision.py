"""The supervisor's loss handling with real processes and real signals (docs/design/engine-faults.md#engine-faults):
silent past the heartbeat deadline -> killed; an expendable actor
dropped or replaced; anything else ends the run."""
from __future__ import annotations

import asyncio
import os
import signal
import tempfile

import pytest

from replayrl.actors import ActorDied, ActorSpec, Directory, Supervisor
from replayrl.actors.errors import PeerLost
from replayrl.actors.ref import heartbeat_ms
from replayrl.actors.supervisor import MAX_FAILED_STARTS

ECHO = "tests.actor_fixtures:EchoActor"


@pytest.fixture
def run_dir():
    with tempfile.TemporaryDirectory(prefix="rrl-") as d:  # short: AF_UNIX path limit
        yield d


def test_heartbeat_interval_is_a_quarter_of_the_deadline_at_most_two_seconds():
    assert heartbeat_ms(1.0) == (250, 1000)
    assert heartbeat_ms(30.0) == (2000, 30000)
    assert heartbeat_ms(0.1) == (25, 100)
    for bad in (0, -1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="heartbeat deadline"):
            heartbeat_ms(bad)


def test_directory_carries_the_deadline_through_its_file(tmp_path):
    directory = Directory.for_run(tmp_path, ["a"], heartbeat_deadline_s=1.5)
    directory.save(tmp_path / "dir.json")
    assert Directory.load(tmp_path / "dir.json").heartbeat_deadline_s == 1.5
    with pytest.raises(ValueError, match="heartbeat deadline"):
        Directory({"a": "ipc:///x"}, "", 0.0)


async def _watch_until(sup: Supervisor, condition, timeout: float = 30.0) -> None:
    watch = asyncio.ensure_future(sup.watch())
    try:
        for _ in range(int(timeout / 0.05)):
            if watch.done():
                watch.result()
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("condition not reached")
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)


async def test_a_stopped_actor_is_killed_at_the_deadline_and_ends_the_run(run_dir):
    directory = Directory.for_run(run_dir, ["a"], heartbeat_deadline_s=0.5)
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir) as sup:
        pid = sup.processes["a"].pid
        call = asyncio.ensure_future(directory.ref("a").call("sleep", 5.0))
        await asyncio.sleep(0.2)  # the call reached the actor
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(ActorDied) as died:
            await asyncio.wait_for(sup.watch(), 30)
        assert died.value.actor == "a" and died.value.exitcode == -signal.SIGKILL
        assert "heartbeat deadline" in str(died.value)
        with pytest.raises(PeerLost):  # the call in flight was failed, not left waiting
            await asyncio.wait_for(call, 30)


async def test_an_expendable_actor_is_dropped_until_the_last(run_dir):
    directory = Directory.for_run(run_dir, ["a", "b", "c"], heartbeat_deadline_s=0.5)
    specs = [ActorSpec(n, ECHO) for n in ("a", "b", "c")]
    async with Supervisor(specs, directory, run_dir, expendable=("b", "c"),
                          on_lost="drop") as sup:
        os.kill(sup.processes["b"].pid, signal.SIGKILL)
        await _watch_until(sup, lambda: "b" in sup.dropped)
        os.kill(sup.processes["c"].pid, signal.SIGSTOP)
        with pytest.raises(ActorDied, match=r"every one of \['b', 'c'\] is lost") as died:
            await asyncio.wait_for(sup.watch(), 30)
        assert "heartbeat deadline" in str(died.value)  # c was stopped, not exited
        assert sup.processes["c"].exitcode == -signal.SIGKILL
        assert await directory.ref("a").call("echo", 2) == 2  # the others were untouched


async def test_an_expendable_actor_is_replaced_and_announced(run_dir):
    directory = Directory.for_run(run_dir, ["a", "b"], heartbeat_deadline_s=0.5)
    replaced: list[str] = []

    async def on_replaced(name: str) -> None:
        replaced.append(name)

    specs = [ActorSpec("a", ECHO), ActorSpec("b", ECHO, {"tag": "b"})]
    async with Supervisor(specs, directory, run_dir, expendable=("b",), on_lost="replace",
                          on_replaced=on_replaced) as sup:
        old = sup.processes["b"].pid
        os.kill(old, signal.SIGSTOP)  # silent, then killed and replaced
        await _watch_until(sup, lambda: replaced == ["b"])
        assert sup.replacements == {"b": 1}
        new = await directory.ref("b").call("pid", timeout=10)
        assert new == sup.processes["b"].pid != old


async def _kill_replacements(run_dir, kills: int) -> tuple[Supervisor, list[int]]:
    """A supervisor whose expendable ``b`` is SIGKILLed, then each of its first ``kills``
    replacements killed while being restored (inside ``on_replaced``, which then calls it);
    returns it (stopped) and the pids of ``b``'s processes."""
    directory = Directory.for_run(run_dir, ["a", "b"], heartbeat_deadline_s=0.5)
    pids: list[int] = []

    async def on_replaced(name: str) -> None:
        pids.append(sup.processes[name].pid)
        if len(pids) <= kills + 1:  # the first process and `kills` replacements die
            os.kill(pids[-1], signal.SIGKILL)
            await directory.ref(name).call("pid", timeout=10)  # cut off: PeerLost

    specs = [ActorSpec("a", ECHO), ActorSpec("b", ECHO, {"tag": "b"})]
    async with Supervisor(specs, directory, run_dir, expendable=("b",), on_lost="replace",
                          on_replaced=on_replaced) as sup:
        pids.append(sup.processes["b"].pid)
        os.kill(pids[0], signal.SIGKILL)
        await _watch_until(sup, lambda: len(pids) == kills + 2, timeout=60)
        if kills < MAX_FAILED_STARTS:
            assert await directory.ref("b").call("pid", timeout=10) == pids[-1]
    return sup, pids


async def test_a_replacement_lost_while_starting_is_replaced_again(run_dir):
    # a chaos kill can land on a restarting engine: that is a loss of it, not of the run
    sup, pids = await _kill_replacements(run_dir, 1)
    assert len(set(pids)) == 3 and sup.replacements == {"b": 2}


async def test_a_replacement_lost_on_every_start_ends_the_run(run_dir):
    # three in a row: a process that dies on every start is broken; the run ends naming it
    with pytest.raises(ActorDied, match="3 replacements in a row were lost while starting") as info:
        await _kill_replacements(run_dir, MAX_FAILED_STARTS)
    assert info.value.actor == "b" and info.value.exitcode == -signal.SIGKILL


def test_unknown_loss_policy_and_expendable_names_are_refused(tmp_path):
    directory = Directory.for_run(tmp_path, ["a"])
    with pytest.raises(ValueError, match="on_lost"):
        Supervisor([ActorSpec("a", ECHO)], directory, tmp_path, on_lost="ignore")
    with pytest.raises(ValueError, match="not among"):
        Supervisor([ActorSpec("a", ECHO)], directory, tmp_path, expendable=("z",))


@pytest.mark.skipif(not os.path.exists("/proc/self/comm"), reason="reads /proc (Linux)")
async def test_ps_names_each_actor_process_and_its_run(run_dir):
    def shown(pid: int) -> tuple[str, str]:
        # the command line as ps -f shows it (NUL-separated, padded), the comm name as top does
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
        return cmdline, open(f"/proc/{pid}/comm").read().strip()

    directory = Directory.for_run(run_dir, ["rollout_manager", "engine_0"])
    specs = [ActorSpec("rollout_manager", ECHO), ActorSpec("engine_0", ECHO)]
    async with Supervisor(specs, directory, run_dir, run_name="/data/run-7") as sup:
        titles = {name: shown(proc.pid) for name, proc in sup.processes.items()}
    # comm: "rrl:" and the name, cut by the kernel at 15 characters (TASK_COMM_LEN 16 with NUL)
    assert titles == {"rollout_manager": ("replayrl actor rollout_manager run /data/run-7", "rrl:rollout_man"),
                      "engine_0": ("replayrl actor engine_0 run /data/run-7", "rrl:engine_0")}
    directory = Directory.for_run(run_dir, ["a"])
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir) as sup:  # no run name
        assert shown(sup.processes["a"].pid) == (f"replayrl actor a run {run_dir}", "rrl:a")


async def test_a_supervisor_leaves_the_launchers_own_actors_serving(run_dir):
    # the launcher serves the clock and the manager itself (DriverActors) in the directory the
    # supervisor's processes use; the supervisor's shutdown removes only its own actors' ipc files
    # (removing every one left the launcher's final __stop__ calls unanswered, and it hung)
    from replayrl.actors import DRIVER, DriverActors

    directory = Directory.for_run(run_dir, ["clock", "engine_0"])
    driver = DriverActors([ActorSpec("clock", ECHO, process=DRIVER)], directory)
    async with Supervisor([ActorSpec("engine_0", ECHO)], directory, run_dir) as sup:
        assert await directory.ref("engine_0").call("pid", timeout=10) == sup.processes["engine_0"].pid
    assert await directory.ref("clock").call("pid", timeout=10) == os.getpid()
    await asyncio.wait_for(driver.stop(), 10)
    assert driver.task.done() and driver.failure() is None
