"""Several actors in one process (docs/design/actors.md#colocate): grouping of specs, the Supervisor's
checks, the error that names every member, and serving two actors in one event loop
(in-process; the spawned path is tests/system/test_colocate.py)."""
from __future__ import annotations

import asyncio
import os
import pickle
import tempfile
import threading
import time

import pytest

from replayrl.actors import ActorDied, ActorSpec, Directory, Supervisor, process_groups, serve_actors
from replayrl.actors.serve import serve_in_threads
from tests.actor_fixtures import EchoActor

ECHO = "tests.actor_fixtures:EchoActor"


def test_specs_that_name_one_process_are_grouped_in_order():
    specs = [ActorSpec("clock", ECHO, process="p"), ActorSpec("engine_1", ECHO),
             ActorSpec("engine_0", ECHO, process="p"), ActorSpec("trainer", ECHO, process="p")]
    groups = process_groups(specs)
    assert list(groups) == ["p", "engine_1"]
    assert [s.name for s in groups["p"]] == ["clock", "engine_0", "trainer"]
    assert [s.name for s in groups["engine_1"]] == ["engine_1"]
    # without process, every spec is a group of one, keyed by its name
    assert {k: [s.name for s in v] for k, v in process_groups(specs[1:2]).items()} == {"engine_1": ["engine_1"]}


def test_members_of_one_process_must_agree_on_cpus_and_env():
    with pytest.raises(ValueError, match="'a' and 'b'.*cpus"):
        process_groups([ActorSpec("a", ECHO, cpus=(0,), process="p"),
                        ActorSpec("b", ECHO, cpus=(1,), process="p")])
    with pytest.raises(ValueError, match=r"'a' and 'b'.*env \['X'\]"):
        process_groups([ActorSpec("a", ECHO, env={"X": "1"}, process="p"),
                        ActorSpec("b", ECHO, env={"X": "2"}, process="p")])
    # distinct keys, or equal values, are fine
    groups = process_groups([ActorSpec("a", ECHO, env={"X": "1"}, process="p"),
                             ActorSpec("b", ECHO, env={"X": "1", "Y": "2"}, process="p")])
    assert len(groups["p"]) == 2


def test_a_shared_expendable_actor_needs_on_lost_fail(tmp_path):
    specs = [ActorSpec("trainer", ECHO, process="p"), ActorSpec("engine_0", ECHO, process="p"),
             ActorSpec("engine_1", ECHO)]
    directory = Directory.for_run(tmp_path, [s.name for s in specs])
    for policy in ("drop", "replace"):
        with pytest.raises(ValueError, match=r"\['engine_0'\] share a process"):
            Supervisor(specs, directory, tmp_path, expendable=("engine_0", "engine_1"), on_lost=policy)
    # an expendable actor in a process of its own may be dropped or replaced
    sup = Supervisor(specs, directory, tmp_path, expendable=("engine_1",), on_lost="replace")
    assert sup.groups.keys() == {"p", "engine_1"}
    Supervisor(specs, directory, tmp_path, expendable=("engine_0", "engine_1"), on_lost="fail")


def test_actor_died_names_every_member_and_pickles():
    dead = ActorDied("engine_0", 1, "Traceback: boom", ("version_clock", "engine_0", "trainer"))
    assert str(dead).startswith("actors 'version_clock', 'engine_0', 'trainer' (one process) "
                                "exited with code 1")
    assert "Traceback: boom" in str(dead)
    again = pickle.loads(pickle.dumps(dead))
    assert (again.actor, again.exitcode, again.members, str(again)) == (
        "engine_0", 1, ("version_clock", "engine_0", "trainer"), str(dead))
    # a process of one actor reads as before
    assert str(ActorDied("a", 3)) == "actor 'a' exited with code 3"


async def test_two_actors_serve_in_one_event_loop_under_their_own_names():
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:  # short: AF_UNIX path limit
        directory = Directory.for_run(run_dir, ["a", "b"])
        serving = asyncio.ensure_future(serve_actors([(EchoActor("a"), "a"), (EchoActor("b"), "b")],
                                                     directory))
        a, b = directory.ref("a"), directory.ref("b")
        pings = [await ref.call("__ping__", timeout=10) for ref in (a, b)]
        assert pings == [{"name": "a", "pid": os.getpid()}, {"name": "b", "pid": os.getpid()}]
        # each keeps its own state and order
        await a.call("record", 1)
        await b.call("record", 2)
        assert (await a.call("recorded"), await b.call("recorded")) == ([1], [2])
        # one member stops; the other still serves, and the call returns once both stopped
        assert await a.call("__stop__", "a failed") is True
        await asyncio.sleep(0.2)
        assert not serving.done()
        assert await b.call("echo", "still here", timeout=10) == "still here"
        assert await b.call("__stop__") is True
        assert await asyncio.wait_for(serving, 10) == ["a failed", ""]


class Blocking(EchoActor):
    """Reports its thread and blocks it (``time.sleep`` releases the GIL, as torch ops do)."""

    async def thread(self) -> int:
        return threading.get_ident()

    async def block(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


async def _blocked_seconds(a, b, seconds: float) -> float:
    start = time.perf_counter()
    assert await asyncio.gather(a.call("block", seconds, timeout=30),
                                b.call("block", seconds, timeout=30)) == [seconds, seconds]
    return time.perf_counter() - start


async def test_actors_on_loops_of_their_own_threads_overlap():
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:  # short: AF_UNIX path limit
        directory = Directory.for_run(run_dir, ["a", "b", "c"])
        errors = []
        loops = [[(Blocking("a"), "a")], [(Blocking("b"), "b"), (Blocking("c"), "c")]]
        serving = asyncio.ensure_future(asyncio.to_thread(serve_in_threads, loops, directory, None,
                                                          errors.append))
        a, b, c = (directory.ref(n) for n in "abc")
        threads = [await ref.call("thread", timeout=10) for ref in (a, b, c)]
        # a on a thread of its own, b and c on one loop of another; none on this test's thread
        assert threads[0] != threads[1] == threads[2] and threading.get_ident() not in threads
        assert [(await ref.call("__ping__"))["pid"] for ref in (a, b, c)] == [os.getpid()] * 3
        # two blocking calls on two threads take about one call's time, on one loop two
        assert await _blocked_seconds(a, b, 1.0) < 1.8
        assert await _blocked_seconds(b, c, 0.5) >= 1.0
        for ref, why in ((a, "a failed"), (b, ""), (c, "")):
            await ref.call("__stop__", why, timeout=10)
        assert await asyncio.wait_for(serving, 10) == ["a failed", "", ""]
        assert errors == []


class _ExitsOnSecondRead:
    """A process stand-in that is running at the first read of ``exitcode`` and has exited with
    code 3 at every later read (a process that exits between two reads)."""

    sentinel = -1

    def __init__(self) -> None:
        self.reads = 0

    @property
    def exitcode(self) -> int | None:
        self.reads += 1
        return None if self.reads == 1 else 3


def test_a_shared_process_that_exits_between_reads_is_reported_under_its_first_member():
    # read per member, the exit would show first at b's read and be reported as b's (the
    # supervisor's watch reads the same way: Supervisor._exit_codes)
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        specs = [ActorSpec("a", ECHO, process="p"), ActorSpec("b", ECHO, process="p")]
        sup = Supervisor(specs, Directory.for_run(run_dir, ["a", "b"]), run_dir)
        proc = _ExitsOnSecondRead()
        sup.processes = {"a": proc, "b": proc}
        assert sup.died() is None  # one read for both: running
        dead = sup.died()
        assert (dead.actor, dead.exitcode, dead.members) == ("a", 3, ("a", "b"))
