"""An actor stopped under a running call: the call's late failure is answered to nobody and ends
nothing in error (a run stopped by SIGTERM / Ctrl-C logs no error: tests/system/test_end_to_end.py)."""
from __future__ import annotations

import asyncio

from replayrl.actors import Actor
from tests.in_process_actor import serving


class Stopper(Actor):
    """Its call turns the server's cancel into an error of its own, as a call does whose awaited
    call to another actor failed in the same loop iteration (asyncio.wait_for then raises that
    failure, not the cancel)."""

    def __init__(self) -> None:
        self.running = asyncio.Event()

    async def work(self) -> None:
        self.running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("connection to version_clock closed during set_trainer_version") from None


async def test_a_call_that_fails_after_close_ends_the_worker_without_an_error(tmp_path):
    actor = Stopper()
    with serving(actor, "stopper", tmp_path) as (directory, server):
        pending = asyncio.ensure_future(directory.ref("stopper").call("work"))
        await asyncio.wait_for(actor.running.wait(), 10)
        worker = server._worker
        server.close()  # as the actor process does on SIGTERM
        await asyncio.wait([worker], timeout=10)
        assert worker.done() and not worker.cancelled() and worker.exception() is None
        pending.cancel()
