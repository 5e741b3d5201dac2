"""The rollout side's pause / resume gate (rollout/dispatch/generation_gate.py)."""
from __future__ import annotations

import asyncio

from replayrl.rollout.dispatch.generation_gate import GenerationGate


async def test_a_closed_gate_holds_new_requests_and_lets_those_in_flight_finish():
    gate = GenerationGate()
    served: list[str] = []
    release_first = asyncio.Event()

    async def request(name: str, hold: asyncio.Event | None = None) -> None:
        async with gate.request():
            if hold is not None:
                await hold.wait()
            served.append(name)

    first = asyncio.ensure_future(request("first", release_first))
    await asyncio.sleep(0)
    assert gate.state() == {"paused": False, "in_flight": 1, "held": 0}
    gate.pause()
    second = asyncio.ensure_future(request("second"))
    drained = asyncio.ensure_future(gate.drained())
    await asyncio.sleep(0)
    assert gate.state() == {"paused": True, "in_flight": 1, "held": 1}
    assert not drained.done()
    release_first.set()  # the request already sent finishes while paused
    await first
    await drained
    assert served == ["first"] and gate.state() == {"paused": True, "in_flight": 0, "held": 1}
    gate.resume()
    await second
    assert served == ["first", "second"]
    assert gate.state() == {"paused": False, "in_flight": 0, "held": 0}


async def test_a_cancelled_held_request_leaves_the_counts_right():
    gate = GenerationGate()
    gate.pause()

    async def request() -> None:
        async with gate.request():
            pass

    held = asyncio.ensure_future(request())
    await asyncio.sleep(0)
    assert gate.state()["held"] == 1
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    assert gate.state() == {"paused": True, "in_flight": 0, "held": 0}
    await asyncio.wait_for(gate.drained(), 5)  # nothing in flight: returns at once
