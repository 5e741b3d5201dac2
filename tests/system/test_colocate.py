"""Colocated mode across real processes (docs/design/actors.md#colocate): actors that share one spawned
process, and ``replayrl train --colocate`` against the same run in separate processes."""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

import pytest

from replayrl.actors import ActorDied, ActorSpec, Directory, Supervisor, run_event_loop
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import launch

ECHO = "tests.actor_fixtures:EchoActor"
CHILD_TITLES: list[set[str]] = []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def record_children(config, metrics) -> None:
    """Metrics hook (it runs in the launcher, this process): the ``comm`` names of this
    process's live children, the actor processes among them."""
    me, titles = os.getpid(), set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        if int(rest.split()[1]) == me and name.startswith("rrl:"):
            titles.add(name)
    CHILD_TITLES.append(titles)


async def test_actors_of_one_process_share_it_and_are_lost_together():
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:  # short: AF_UNIX path limit
        directory = Directory.for_run(run_dir, ["a", "b", "c"])
        specs = [ActorSpec("a", ECHO, {"tag": "a"}, process="p"), ActorSpec("c", ECHO),
                 ActorSpec("b", ECHO, {"tag": "b"}, process="p")]
        async with Supervisor(specs, directory, run_dir) as sup:
            a, b, c = (directory.ref(n) for n in "abc")
            pid = await a.call("pid")
            assert pid == await b.call("pid") == sup.processes["a"].pid == sup.processes["b"].pid
            assert await c.call("pid") == sup.processes["c"].pid not in (pid, os.getpid())
            assert (await a.call("__ping__"))["name"] == "a" and (await b.call("__ping__"))["name"] == "b"
            b.tell("crash")  # the process of a and b exits with code 3
            with pytest.raises(ActorDied) as info:
                await asyncio.wait_for(sup.watch(), 20)
            dead = info.value
            assert (dead.actor, dead.exitcode, dead.members) == ("a", 3, ("a", "b"))
            assert "actors 'a', 'b' (one process) exited with code 3" in str(dead)
            other = sup.processes["c"].pid
        assert not _alive(pid) and not _alive(other)  # the shutdown ended both processes


def _run(output: Path, **flags) -> tuple[list[dict], set[str]]:
    """A 3-step run: its metrics rows and the comm names of its actor processes."""
    CHILD_TITLES.clear()
    config = build_config({"num-steps": 3, "seed": 1, "progress": False, "rollout-batch-size": 4,
                           "n-samples-per-prompt": 4, "output-dir": str(output),
                           "metrics-hook": ["tests.system.test_colocate:record_children"], **flags})
    result = run_event_loop(launch(config))
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    return rows, set.union(*CHILD_TITLES)


@pytest.fixture(scope="module")
def separate(tmp_path_factory):
    """The run in separate processes, the reference of the colocated ones."""
    rows, titles = _run(tmp_path_factory.mktemp("separate"))
    # the launcher serves the clock and the manager itself: two actor processes
    assert titles == {"rrl:engine_0", "rrl:trainer"}
    return rows


@pytest.mark.parametrize("threads", [False, True], ids=["one-loop", "threads"])
def test_colocated_run_gives_the_separate_processes_metrics(separate, tmp_path, threads):
    # same seed, same thread counts: every non-timing metric equal at every step
    rows, titles = _run(tmp_path, **{"colocate": True, "colocate-threads": threads})
    assert titles == {"rrl:colocated"}  # one actor process
    assert [r["step"] for r in rows] == [0, 1, 2]
    timing = ("_seconds", "per_second")
    for alone, shared in zip(separate, rows):
        assert alone.keys() == shared.keys()
        differ = {k for k in alone if not k.endswith(timing) and alone[k] != shared[k]}
        assert not differ, {k: (alone[k], shared[k]) for k in differ}
    # the one-step overlap's staleness holds as it does in separate processes
    assert [r["staleness_max"] for r in rows] == [0, 1, 1]
