"""Actor runtime across real processes: calls, remote errors, timeouts, supervision, cleanup."""
from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from replayrl.actors import (
    ActorDied,
    ActorServer,
    ActorSpec,
    ActorTimeout,
    Directory,
    RemoteError,
    Supervisor,
    UnknownActor,
)
from replayrl.transport import Codec, DealerSocket
from tests.actor_fixtures import EchoActor

ECHO = "tests.actor_fixtures:EchoActor"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def run_dir(tmp_path_factory):
    # short path: AF_UNIX socket paths are limited to ~107 bytes
    import tempfile
    with tempfile.TemporaryDirectory(prefix="rrl-") as d:
        yield d


async def test_call_across_processes_remote_error_and_timeout(run_dir):
    directory = Directory.for_run(run_dir, ["a", "b"])
    specs = [ActorSpec("a", ECHO, {"tag": "a"}), ActorSpec("b", ECHO, {"tag": "b"})]
    async with Supervisor(specs, directory, run_dir) as sup:
        a = directory.ref("a")
        assert await a.call("echo", {"x": [1, 2.5, "s"]}) == {"x": [1, 2.5, "s"]}
        big = np.arange(100_000, dtype=np.float32)  # 400 KB: out-of-band frame
        assert await a.call("total", big) == float(big.astype(np.float64).sum())
        assert await a.call("pid") == sup.processes["a"].pid != os.getpid()

        with pytest.raises(RemoteError) as info:
            await a.call("fail", "bad input 42")
        err = info.value
        assert err.remote_type == "ValueError" and err.remote_message == "bad input 42"
        assert "actor_fixtures.py" in err.remote_traceback and "raise ValueError" in err.remote_traceback

        with pytest.raises(ActorTimeout):
            await a.call("sleep", 2.0, timeout=0.2)
        # the actor survives and the late reply does not confuse the next call
        assert await a.call("echo", 7, timeout=5) == 7

        with pytest.raises(RemoteError, match="no public async method"):
            await a.call("_private")
        with pytest.raises(UnknownActor):
            directory.ref("nobody")


async def test_calls_run_in_arrival_order_and_concurrent_methods_do_not_block(run_dir):
    directory = Directory.for_run(run_dir, ["a"])
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir):
        a = directory.ref("a")
        for i in range(50):
            a.tell("record", i)
        assert await a.call("recorded") == list(range(50))
        start = time.monotonic()
        results = await asyncio.gather(*(a.call("sleep_concurrently", 0.3) for _ in range(4)))
        assert results == ["slept"] * 4
        assert time.monotonic() - start < 1.0  # 4 x 0.3 s would take 1.2 s in order


async def test_tcp_loopback_transport(run_dir, curve_keys_dir):
    directory = Directory.for_run(run_dir, ["a"], transport="tcp", curve_keys=curve_keys_dir)
    assert directory.endpoint("a").startswith("tcp://127.0.0.1:")
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir):
        assert await directory.ref("a").call("echo", "over tcp") == "over tcp"


async def test_malformed_message_is_answered_and_actor_survives(run_dir):
    directory = Directory.for_run(run_dir, ["a"])
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir):
        replies: asyncio.Queue = asyncio.Queue()
        raw = DealerSocket(directory.endpoint("a"), replies.put_nowait)
        raw.connect()
        try:
            raw.send([b"\xc1 not msgpack"])  # undecodable: dropped, logged
            raw.send(Codec().encode({"k": "call", "id": 5, "m": 3}))  # bad method field
            reply = Codec().decode(await asyncio.wait_for(replies.get(), 5))
            assert reply["k"] == "err" and reply["id"] == 5 and reply["t"] == "ProtocolError"
        finally:
            raw.close()
        assert await directory.ref("a").call("echo", "still alive", timeout=5) == "still alive"


async def test_actor_death_is_reported_with_traceback_and_nothing_is_left(run_dir):
    directory = Directory.for_run(run_dir, ["a", "b"])
    sup = Supervisor([ActorSpec("a", ECHO), ActorSpec("b", ECHO)], directory, run_dir)
    async with sup:
        pids = [p.pid for p in sup.processes.values()]
        directory.ref("a").tell("crash")
        with pytest.raises(ActorDied) as info:
            await asyncio.wait_for(sup.watch(), 10)
        assert info.value.actor == "a" and info.value.exitcode == 3
    assert not any(_alive(pid) for pid in pids)
    assert not [f for f in os.listdir(run_dir) if not f.endswith(".traceback")]


async def test_constructor_error_fails_start_with_its_traceback(run_dir):
    directory = Directory.for_run(run_dir, ["ok", "bad"])
    specs = [ActorSpec("ok", ECHO), ActorSpec("bad", "tests.actor_fixtures:CrashOnStart")]
    sup = Supervisor(specs, directory, run_dir, ready_timeout=60)
    with pytest.raises(ActorDied, match="boom in constructor") as info:
        async with sup:
            pass
    assert info.value.actor == "bad"
    assert all(p.exitcode is not None for p in sup.processes.values())
    assert not [f for f in os.listdir(run_dir) if not f.endswith(".traceback")]


async def test_a_stuck_start_is_reported_while_it_lasts_then_fails_naming_the_actor(run_dir, capfd):
    # the waits are reported (which actor, since when), and after its timeout the stuck actor
    # is named, its stack printed (faulthandler, SIGUSR1) and every process stopped
    directory = Directory.for_run(run_dir, ["ok", "stuck"])
    specs = [ActorSpec("ok", ECHO), ActorSpec("stuck", "tests.actor_fixtures:HangOnStart")]
    reports: list = []
    sup = Supervisor(specs, directory, run_dir, ready_timeout=60, ready_timeouts={"stuck": 3.0},
                     on_waiting=lambda *report: reports.append(report), waiting_report_s=(1.0, 1.0),
                     timeout_hint="raise --the-flag")
    start = time.monotonic()
    with pytest.raises(ActorTimeout, match=r"actor 'stuck' \(pid \d+\) did not answer its first ping "
                                           r"within 3 s.*raise --the-flag") as info:
        async with sup:
            pass
    assert time.monotonic() - start < 30  # its own 3 s, not the other actor's 60 s
    assert str(sup.processes["stuck"].pid) in str(info.value)
    assert reports and all(waiting[-1] == "stuck" and 1.0 <= seconds <= 3.5 for waiting, seconds, _ in reports)
    assert all(timeout == {"ok": 60, "stuck": 3.0}[waiting[0]] for waiting, _, timeout in reports)
    stacks = capfd.readouterr().err  # printed by the stuck process itself
    assert 'actor_fixtures.py", line' in stacks and "in __init__" in stacks
    assert all(p.exitcode is not None for p in sup.processes.values())


async def test_in_process_server_with_ordered_methods(run_dir):
    # the same server class used in-process (as the REPL and tests do), no spawn
    directory = Directory.for_run(run_dir, ["local"])
    actor = EchoActor("local")
    actor.name, actor.directory = "local", directory
    server = ActorServer(actor, directory.endpoint("local"))
    server.start()
    try:
        ref = directory.ref("local")
        assert await ref.call("echo", (1, "two")) == (1, "two")
        assert await ref.call("__ping__") == {"name": "local", "pid": os.getpid()}
    finally:
        server.close()
