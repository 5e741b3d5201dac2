"""Actors a launcher serves in its own event loop (``DriverActors``; the version clock and the
rollout manager of ``replayrl train``): built before anything serves, answering under their own
names beside the caller's work, stopped on request, an ``on_start`` error reported."""
from __future__ import annotations

import asyncio
import os
import tempfile

import pytest

from replayrl.actors import DRIVER, Actor, ActorDied, ActorSpec, Directory, DriverActors, RemoteError

ECHO = "tests.actor_fixtures:EchoActor"


class StartFails(Actor):
    """Constructs, then fails in ``on_start`` (after the launcher went on)."""

    async def on_start(self) -> None:
        raise RuntimeError("no prompts at on_start")


async def test_driver_actors_answer_in_this_process_then_stop():
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:  # short: AF_UNIX path limit
        directory = Directory.for_run(run_dir, ["clock", "manager"])
        driver = DriverActors([ActorSpec("clock", ECHO, {"tag": "c"}, process=DRIVER),
                               ActorSpec("manager", ECHO, process=DRIVER)], directory)
        clock, manager = directory.ref("clock"), directory.ref("manager")
        assert await clock.call("__ping__", timeout=10) == {"name": "clock", "pid": os.getpid()}
        assert await manager.call("echo", [1, "x"], timeout=10) == [1, "x"]
        with pytest.raises(RemoteError, match="ValueError: bad"):
            await manager.call("fail", "bad", timeout=10)
        # the caller's own coroutine runs beside them on the same loop
        assert await asyncio.wait_for(clock.call("sleep", 0.01, timeout=10), 10) == "slept"
        await driver.stop()
        assert driver.task.done() and driver.failure() is None
        # the ipc endpoints are gone with the servers
        assert not any(os.path.exists(e[len("ipc://"):]) for e in directory.endpoints.values())


async def test_an_on_start_error_is_the_failure_and_stop_still_returns():
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        directory = Directory.for_run(run_dir, ["clock", "manager"])
        driver = DriverActors([ActorSpec("clock", ECHO, process=DRIVER),
                               ActorSpec("manager", f"{__name__}:StartFails", process=DRIVER)],
                              directory)
        await asyncio.wait({driver.task}, timeout=10)
        assert isinstance(driver.failure(), RuntimeError)
        assert "no prompts at on_start" in str(driver.failure())
        await asyncio.wait_for(driver.stop(timeout=0.5), 10)


async def test_a_constructor_error_raises_before_anything_serves():
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        directory = Directory.for_run(run_dir, ["clock", "bad"])
        with pytest.raises(RuntimeError, match="boom in constructor"):
            DriverActors([ActorSpec("clock", ECHO, process=DRIVER),
                          ActorSpec("bad", "tests.actor_fixtures:CrashOnStart", process=DRIVER)],
                         directory)
        assert not any(os.path.exists(e[len("ipc://"):]) for e in directory.endpoints.values())
        with pytest.raises(ValueError, match="unique"):
            DriverActors([ActorSpec("clock", ECHO), ActorSpec("clock", ECHO)], directory)


async def test_no_specs_serve_nothing():
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        driver = DriverActors([], Directory.for_run(run_dir, []))
        assert driver.task is None and driver.failure() is None
        await driver.stop()


async def test_stop_returns_when_the_stop_call_cannot_arrive():
    # a run whose ipc directory was removed under it (a test's cleanup did, and the launcher hung
    # on its last __stop__ calls): the members are cancelled and stopped anyway
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        directory = Directory.for_run(run_dir, ["clock"])
        driver = DriverActors([ActorSpec("clock", ECHO, process=DRIVER)], directory)
        await asyncio.sleep(0.2)  # bound: the file exists
        os.unlink(directory.endpoints["clock"][len("ipc://"):])
        await asyncio.wait_for(driver.stop(timeout=0.5), 10)
        assert driver.task.done()


async def test_a_member_stopped_by_someone_else_ends_the_serving_as_actor_died():
    # a console attached to the run sends the manager __stop__: the run must not wait out its
    # next call's timeout, nor (both members stopped) end as if it had completed
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        directory = Directory.for_run(run_dir, ["clock", "manager"])
        driver = DriverActors([ActorSpec("clock", ECHO, process=DRIVER),
                               ActorSpec("manager", ECHO, process=DRIVER)], directory)
        manager = directory.ref("manager")
        await manager.call("__ping__", timeout=10)
        await manager.call("__stop__", "from a console", timeout=10)
        await asyncio.wait({driver.task}, timeout=10)
        failure = driver.failure()
        assert isinstance(failure, ActorDied) and failure.actor == "manager"
        assert "from a console" in str(failure)
        # the other member was stopped with it: its endpoint is gone too
        assert not any(os.path.exists(e[len("ipc://"):]) for e in directory.endpoints.values())
        await asyncio.wait_for(driver.stop(timeout=0.5), 10)


async def test_beside_returns_the_work_or_raises_what_ended_the_members_first():
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        directory = Directory.for_run(run_dir, ["clock"])
        driver = DriverActors([ActorSpec("clock", ECHO, process=DRIVER)], directory)
        clock = directory.ref("clock")
        assert await driver.beside(clock.call("echo", 7, timeout=10)) == 7
        cancelled = asyncio.Event()

        async def training_loop():
            try:
                await asyncio.sleep(60)
            finally:
                cancelled.set()

        async def stop_clock_soon():
            await asyncio.sleep(0.2)
            await clock.call("__stop__", timeout=10)

        stopper = asyncio.ensure_future(stop_clock_soon())
        with pytest.raises(ActorDied, match="clock"):
            await asyncio.wait_for(driver.beside(training_loop()), 10)
        assert cancelled.is_set()
        await stopper
        await driver.stop()


async def test_stop_after_the_run_is_not_a_failure():
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        directory = Directory.for_run(run_dir, ["clock", "manager"])
        driver = DriverActors([ActorSpec("clock", ECHO, process=DRIVER),
                               ActorSpec("manager", ECHO, process=DRIVER)], directory)
        assert await driver.beside(asyncio.sleep(0.05, result="done")) == "done"
        await driver.stop("the run failed")
        assert driver.failure() is None and driver.task.result() == ["the run failed"] * 2
