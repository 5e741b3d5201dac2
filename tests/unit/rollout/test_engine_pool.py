"""EnginePool: which engines serve, and the rerun of a lost engine's work (docs/design/engine-faults.md#engine-faults).
The work here records which engine ran it; losses are real
``PeerLost`` errors raised by the work, as a dropped connection raises them."""
from __future__ import annotations

import asyncio

import pytest

from replayrl.actors.errors import PeerLost
from replayrl.rollout.dispatch.engine_pool import EnginePool
from replayrl.rollout.errors import EnginesLost


def _work(dead: set[str], calls: list[str]):
    async def work(engine: str) -> str:
        calls.append(engine)
        if engine in dead:
            raise PeerLost(f"{engine}.generate: connection lost")
        return f"done on {engine}"
    return work


async def test_lost_engine_work_reruns_on_another_and_later_work_skips_it():
    pool = EnginePool(["e0", "e1", "e2"], "regenerate", 5.0)
    calls: list[str] = []
    result, reruns = await pool.run("e1", _work({"e1"}, calls))
    assert (result, reruns) == ("done on e2", 1) and calls == ["e1", "e2"]
    assert pool.live() == ["e0", "e2"] and pool.losses == 1 and "e1" in pool.lost
    calls.clear()  # work meant for the lost engine goes elsewhere without a rerun
    result, reruns = await pool.run("e1", _work(set(), calls))
    assert reruns == 0 and calls[0] in ("e0", "e2")


async def test_regenerate_with_no_engine_left_raises():
    pool = EnginePool(["e0", "e1"], "regenerate", 5.0)
    with pytest.raises(EnginesLost, match="no engine left"):
        await pool.run("e0", _work({"e0", "e1"}, []))
    assert pool.live() == []


async def test_fail_policy_propagates_the_loss():
    pool = EnginePool(["e0", "e1"], "fail", 5.0)
    with pytest.raises(PeerLost):
        await pool.run("e0", _work({"e0"}, []))
    assert pool.live() == ["e0", "e1"]


async def test_restart_waits_for_a_restored_engine():
    pool = EnginePool(["e0"], "restart", 30.0)
    dead = {"e0"}
    calls: list[str] = []
    task = asyncio.ensure_future(pool.run("e0", _work(dead, calls)))
    while not pool.lost:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert not task.done()  # nothing live: waiting, not failing
    dead.clear()
    pool.restore("e0")
    assert await asyncio.wait_for(task, 5) == ("done on e0", 1)
    assert calls == ["e0", "e0"] and pool.live() == ["e0"]


async def test_restart_gives_up_after_its_timeout():
    pool = EnginePool(["e0"], "restart", 0.1)
    with pytest.raises(EnginesLost):
        await pool.run("e0", _work({"e0"}, []))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([], "regenerate", 1.0)
    with pytest.raises(ValueError, match="--engine-failure"):
        EnginePool(["e0"], "retry", 1.0)
    with pytest.raises(ValueError, match="unknown engine"):
        EnginePool(["e0"], "restart", 1.0).restore("e9")
