"""No send API lets a caller's later write change a message already sent: one-way sends, calls
that are not awaited at once, typed proxy calls and the server's replies all carry the array as
it was when the send was made (docs/design/transport.md#transport-contract)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from replayrl.actors import Actor, ActorProxy
from tests.in_process_actor import serving

N = 16 * 1024 * 1024  # 64 MiB of float32: ZeroMQ's I/O thread is still reading when we write


class Keeper(Actor):
    """Remembers the (min, max) of every array it receives; hands out a buffer it reuses."""

    def __init__(self) -> None:
        self.kept: list[tuple[float, float]] = []
        self.buffer = np.zeros(N, np.float32)

    async def keep(self, array: np.ndarray) -> None:
        self.kept.append((float(array.min()), float(array.max())))

    async def summary(self) -> list[tuple[float, float]]:
        return self.kept

    async def give(self) -> np.ndarray:
        return self.buffer  # the reply aliases the actor's buffer...

    async def overwrite(self) -> None:
        self.buffer[:] = 1.0  # ...which the actor reuses right after


@pytest.fixture
async def keeper(tmp_path):
    with serving(Keeper(), "keeper", tmp_path) as (directory, _):
        yield directory.ref("keeper")


async def test_a_write_after_tell_does_not_reach_the_message(keeper):
    array = np.zeros(N, np.float32)
    keeper.tell("keep", array)
    array[:] = 1.0  # right after the one-way send, as a caller reusing its buffer does
    assert await keeper.call("summary") == [(0.0, 0.0)]


async def test_a_call_not_awaited_yet_sends_the_array_as_it_was_at_the_call(keeper):
    array = np.zeros(N, np.float32)
    pending = asyncio.ensure_future(keeper.call("keep", array))
    array[:] = 1.0  # before the task has run at all
    await pending
    proxied = np.zeros(N, np.float32)
    pending = asyncio.ensure_future(ActorProxy(keeper).keep(proxied))
    proxied[:] = 1.0
    await pending
    assert await keeper.call("summary") == [(0.0, 0.0), (0.0, 0.0)]


async def test_an_actor_reusing_a_buffer_it_returned_does_not_change_the_reply(keeper):
    reply = asyncio.ensure_future(keeper.call("give"))
    await asyncio.sleep(0)  # the call is sent; the overwrite is queued right behind it
    keeper.tell("overwrite")
    array = await reply
    assert (float(array.min()), float(array.max())) == (0.0, 0.0)
