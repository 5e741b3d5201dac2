"""The event loop thread of a REPL session (docs/design/multi-host.md#attach-and-multi-host).

The actor runtime is asyncio and a connection belongs to the event loop that opened it, so a
session runs one event loop in a background thread, serving one run (its own actors or an
attached run, :mod:`replayrl.tools.console.runs`), and the console (main thread) hands every
call to it with :func:`asyncio.run_coroutine_threadsafe`, blocking until the reply.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Awaitable, Callable, Coroutine

from replayrl.actors import close_connections, run_event_loop
from replayrl.tools.errors import SessionClosed

__all__ = ["ActorLoop", "Serve", "Guard"]

log = logging.getLogger(__name__)

_STOP_JOIN_SECONDS = 60.0  # shutdown: polite stop (<= 2.5 s) + joins (<= 7 s) + margin

Serve = Callable[[Callable[[], None], Callable[[], Awaitable[Any]]], Awaitable[None]]
"""``serve(ready, stopped)``: the loop's one coroutine; calls ``ready()`` once the run answers,
then awaits ``stopped()`` and leaves the run (:mod:`replayrl.tools.console.runs`)."""

Guard = Callable[[Coroutine[Any, Any, Any]], Awaitable[Any]]
"""``guard(coro)``: awaits ``coro`` on the loop, turning the run's own failures (a dead actor
process) into the call's error."""


class ActorLoop:
    """One asyncio event loop in a background thread: serves one run, runs the console's calls.

    Args:
        leave_failure: how a failure while leaving the run is logged (``"repl: <leave_failure>:
            <error>"``).
    """

    def __init__(self, leave_failure: str) -> None:
        self._leave_failure = leave_failure
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.open = False
        """True from a successful :meth:`start` until :meth:`stop`: calls may be made."""

    @property
    def started(self) -> bool:
        """Whether :meth:`start` was called (a loop is started once)."""
        return self._thread is not None

    def start(self, serve: Serve) -> None:
        """Start the thread running ``serve`` and block until it called ``ready()``.

        Raises:
            whatever ``serve`` raised before calling ``ready()`` (the caller stops the loop).
            KeyboardInterrupt: Ctrl-C while waiting (the caller stops the loop).
        """
        self._thread = threading.Thread(target=run_event_loop, args=(self._serve(serve),),
                                        name="replayrl-repl-loop", daemon=True)
        self._thread.start()
        self._ready.wait()  # set on success and on failure; Ctrl-C lands in the caller's except
        if self._start_error is not None:
            raise self._start_error
        self.open = True

    async def _serve(self, serve: Serve) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        try:
            await serve(self._ready.set, self._stop_event.wait)
        except BaseException as exc:
            if not self._ready.is_set():
                self._start_error = exc
            else:
                log.error("repl: %s: %s: %s", self._leave_failure, type(exc).__name__, exc)
        finally:
            close_connections()  # this loop's sockets (a supervisor closes its own too)
            self._ready.set()

    def run(self, coro: Coroutine[Any, Any, Any], guard: Guard) -> Any:
        """Run ``guard(coro)`` on the loop and block until it finishes; return its result.

        Ctrl-C (KeyboardInterrupt) cancels the coroutine on the loop before propagating.

        Raises:
            replayrl.tools.errors.SessionClosed: the loop is not open, or closed
                during the call.
            whatever ``guard(coro)`` raises.
        """
        if not self.open or self._loop is None or self._loop.is_closed():
            coro.close()
            raise SessionClosed("the REPL session is closed; no actor is running")
        future = asyncio.run_coroutine_threadsafe(guard(coro), self._loop)
        try:
            return future.result()  # the timeout is enforced on the loop, by ActorRef.call
        except concurrent.futures.CancelledError:
            raise SessionClosed("the REPL session closed during the call") from None
        except BaseException:
            future.cancel()  # Ctrl-C: do not leave the call running on the loop
            raise

    def stop(self) -> None:
        """Tell ``serve`` to leave (cancelling a start still waiting for the run) and join the
        thread, at most ``_STOP_JOIN_SECONDS`` (logged if it does not finish); idempotent."""
        self.open = False
        thread, loop = self._thread, self._loop
        if thread is not None and thread.is_alive():
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._request_stop)
                except RuntimeError:  # the loop finished between the checks
                    pass
            # bounded by the supervisor's shutdown (polite stop, SIGTERM, SIGKILL); a second
            # Ctrl-C abandons the wait, and the actors then exit on their own once this process
            # is gone (they poll their parent)
            thread.join(_STOP_JOIN_SECONDS)
            if thread.is_alive():
                log.error("repl: event loop thread did not finish within %s s", _STOP_JOIN_SECONDS)

    def _request_stop(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()
        # a start still waiting for pings: cancel it (the supervisor shuts down on the way out)
        if not self._ready.is_set():
            for task in asyncio.all_tasks():
                task.cancel()
