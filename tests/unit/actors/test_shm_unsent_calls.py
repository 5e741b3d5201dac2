"""Shared-memory slots of calls that never reach a socket, and of replies nobody awaits, go back
to their sender at once (docs/design/transport.md#shm-transport): a kept exception's traceback
must not hold a weight push's slot until the cyclic garbage collector runs."""
from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

from replayrl.actors import Actor
from replayrl.actors.errors import ActorTimeout, PeerLost
from replayrl.actors.ref import POOL, send_buffer, shared_memory_pool
from tests.in_process_actor import serving

BIG = np.ones(1 << 18, np.float32)  # 1 MiB: travels in a slot to an ipc peer


class Slow(Actor):
    """Sums arrays; answers with a large array after a delay."""

    async def total(self, array: np.ndarray) -> float:
        return float(np.asarray(array, np.float64).sum())

    async def late_array(self, seconds: float) -> np.ndarray:
        await asyncio.sleep(seconds)
        return np.full(1 << 18, 2.0, np.float32)


@pytest.fixture
async def slow(tmp_path):
    with serving(Slow(), "slow", tmp_path) as (directory, _):
        yield directory


def _busy() -> int:
    gc.collect()  # whatever is garbage now is released; what a live object holds stays busy
    return shared_memory_pool().busy()


async def test_calls_to_a_peer_known_lost_release_their_slots_though_the_errors_are_kept(slow):
    ref, proxy = slow.ref("slow"), slow.proxy("slow")
    assert await ref.call("total", BIG) == float(BIG.size)
    before = _busy()
    conn = POOL.connections[(id(asyncio.get_running_loop()), slow.endpoint("slow"))]
    conn.socket._lost = "connection lost (simulated)"  # as its monitor reports a dead peer
    conn.interface = None  # the proxy fetches the interface again: that call fails first
    kept = []
    for call in (lambda: ref.call("total", BIG), lambda: proxy.total(BIG)):
        with pytest.raises(PeerLost) as info:
            await call()
        kept.append(info.value)  # with its traceback, which holds the call's frames
    assert all(e.__traceback__ is not None for e in kept)
    gc.disable()  # nothing may depend on the cyclic collector
    try:
        assert shared_memory_pool().busy() == before
    finally:
        gc.enable()


async def test_a_reply_nobody_awaits_any_more_releases_its_slot(slow):
    ref = slow.ref("slow")
    before = _busy()
    with pytest.raises(ActorTimeout):
        await ref.call("late_array", 0.3, timeout=0.05)
    assert shared_memory_pool().busy() == before  # nothing sent yet by the actor
    await asyncio.sleep(1.0)  # the reply arrives and is dropped (its call is gone)
    assert _busy() == before
    back = await ref.call("late_array", 0.0)  # the slot is reused for the next reply
    assert float(back[0]) == 2.0 and shared_memory_pool().busy() == before + 1


async def test_a_kept_error_of_a_proxy_call_does_not_hold_its_arguments(slow):
    # a weight push's send buffer, passed to a lost engine: once the caller drops it, its slot
    # is free although the call's PeerLost (with its traceback) is kept
    proxy = slow.proxy("slow")
    assert await proxy.total(BIG) == float(BIG.size)
    before = _busy()
    buffer = send_buffer(BIG.size)
    buffer[:] = 1.0
    assert shared_memory_pool().busy() == before + 1  # held by its owner
    conn = POOL.connections[(id(asyncio.get_running_loop()), slow.endpoint("slow"))]
    conn.socket._lost = "connection lost (simulated)"
    with pytest.raises(PeerLost) as info:
        await proxy.total(buffer)
    kept = info.value
    del buffer
    gc.disable()
    try:
        assert kept.__traceback__ is not None and shared_memory_pool().busy() == before
    finally:
        gc.enable()
