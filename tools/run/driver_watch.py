"""A torchrun rank that lost its driver leaves on its own (docs/design/multi-host.md#attach-and-multi-host).

Under torchrun nothing else ends a rank whose driver (rank 0: the loop, the clock, the rollout
manager) is gone or cut off: the rank only serves, its torchrun agent watches local processes
only, and a cut link raises no error on a server socket. So every rank but the driver holds
one more connection, to the driver's ``version_clock``, with the run's CURVE keys and ZMTP
heartbeats at the run's deadline (``--heartbeat-deadline-s``, :func:`replayrl.actors.ref.heartbeat_ms`),
watched from a thread with its own event loop: libzmq answers and times out heartbeats on its
I/O thread, and the watch reads the socket monitor on its own loop, so a rank whose own loop is
blocked (an engine inside a long ``generate``) still notices.

When that connection drops (heartbeats unanswered past the deadline: link cut or host frozen;
or closed: driver process gone) and is not back within ``grace_s`` seconds, the process exits
at once with :data:`replayrl.tools.run.exit_codes.EXIT_DRIVER_LOST`. The grace lets a normal end finish: the
driver stops every other rank (``__stop__``) before its own actors close, so a rank that is
stopping as told has closed the watch long before. A hard ``os._exit`` rather than an exception,
because the rank's main thread may be blocked in native code that would never see one.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading

from replayrl.actors.directory import Directory
from replayrl.actors.ref import heartbeat_ms
from replayrl.tools.run.exit_codes import EXIT_DRIVER_LOST
from replayrl.transport import DealerSocket

log = logging.getLogger(__name__)

DRIVER_ACTOR = "version_clock"
"""The driver rank's actor every other rank watches (the first of the driver's actors)."""


class DriverWatch:
    """Exit this process when its connection to the driver stays lost (module docstring).

    Args:
        directory: the run's directory (endpoint of :data:`DRIVER_ACTOR`, CURVE keys,
            heartbeat deadline).
        ready_timeout_s: the longest the first connection may take; seconds.
        grace_s: how long a dropped connection may stay down before the process exits;
            seconds (default: the run's heartbeat deadline).
        rank: this rank, for the log line.
        exit: called with the exit code instead of ``os._exit`` (tests).
    Raises:
        replayrl.transport.TransportError: the CURVE key files are missing or too open.
    """

    def __init__(self, directory: Directory, ready_timeout_s: float, grace_s: float | None = None,
                 rank: int | str = "?", exit=os._exit) -> None:
        self.endpoint = directory.endpoint(DRIVER_ACTOR)
        self.keys = directory.keys()
        self.heartbeat_ms = heartbeat_ms(directory.heartbeat_deadline_s)
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = directory.heartbeat_deadline_s if grace_s is None else grace_s
        self.rank = rank
        self._exit = exit
        self._loop = asyncio.new_event_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._run, name="driver-watch", daemon=True)

    def start(self) -> "DriverWatch":
        """Connect and watch from a daemon thread; returns ``self``."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching (a rank ending normally); idempotent."""
        if self._thread.is_alive() and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        socket = DealerSocket(self.endpoint, lambda frames: None, curve=self.keys,
                              on_disconnect=self._dropped, on_connect=self._connected,
                              heartbeat_ms=self.heartbeat_ms)
        self._loop.call_soon(socket.connect)
        self._arm(self.ready_timeout_s,
                  f"no connection to the driver at {self.endpoint} within {self.ready_timeout_s} s")
        try:
            self._loop.run_forever()
        finally:
            socket.close()
            self._loop.close()

    def _connected(self) -> None:
        if self._timer is not None:  # connected, or back within the grace
            self._timer.cancel()
            self._timer = None

    def _dropped(self, reason: str) -> None:
        # the first loss counts: repeated refusals (every reconnect) must not push it back
        if self._timer is None:
            self._arm(self.grace_s, f"lost the driver ({reason}) and it was not back within "
                                    f"{self.grace_s} s")

    def _arm(self, seconds: float, why: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(seconds, self._leave, why)

    def _leave(self, why: str) -> None:
        log.error("rank %s: %s; exiting (code %d)", self.rank, why, EXIT_DRIVER_LOST)
        logging.shutdown()
        self._exit(EXIT_DRIVER_LOST)
