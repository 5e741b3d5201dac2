"""One environment instance's own thread and event loop, so its code cannot stall the caller's.

An ``--env`` environment is the user's code: a ``step`` that calls ``time.sleep`` or a blocking
client instead of awaiting would, on the event loop that serves the rollout manager (the
launcher's), freeze every trajectory, every actor call that loop serves and the signal
handlers that run on it (Ctrl-C, SIGTERM). :class:`EnvWorker` runs each instance's calls as
tasks of an event loop of its own on a daemon thread; the caller awaits them with a timeout
that holds whatever the code does, since the caller's loop never runs it.

A call past its timeout is cancelled (an ``await`` ends at once; blocking code ends its
thread's work once it returns) and its worker is closed; a worker closed while a call still
runs is *stranded* until the call returns. Stranded workers are bounded per process
(:data:`MAX_STRANDED`; :func:`stranded` counts them): past the bound :func:`check_stranded`
raises, which ends the run instead of piling up threads of an environment that never returns.
The threads are daemons, so a stranded one never keeps the process alive at exit.

Why threads, not processes (docs/design/engines.md#environments): one instance serves one
trajectory and keeps its state (clients, files, parsed documents) across turns; a thread
needs nothing of it to be picklable, costs no interpreter start per trajectory, and a
blocked one harms nothing but its own trajectory. Its limit: code that holds the GIL without
releasing it (a C extension's long call) still stalls the process, and the environment's
memory is the process's.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Awaitable, Callable, TypeVar

from replayrl.rollout.errors import CallExited, EnvironmentFailure

__all__ = ["EnvWorker", "MAX_STRANDED", "stranded", "check_stranded"]

T = TypeVar("T")

MAX_STRANDED = 64
"""Workers a process may hold stranded (closed while a timed-out call still runs) before
:func:`check_stranded` ends the run: about 64 idle threads (their stacks are reserved, not
touched), and a clear sign that the environment blocks without end."""

_lock = threading.Lock()
_stranded = 0
_ids = itertools.count()


def stranded() -> int:
    """How many closed workers of this process still run a call (their threads are alive)."""
    with _lock:
        return _stranded


def check_stranded(name: str) -> None:
    """Refuse to start more environment work once :data:`MAX_STRANDED` workers are stranded.

    Args:
        name: the environment as messages name it (``--env``'s value).
    Raises:
        EnvironmentFailure: (kind ``"stranded"``) :data:`MAX_STRANDED` or more are stranded.
    """
    count = stranded()
    if count >= MAX_STRANDED:
        raise EnvironmentFailure(
            f"environment {name}: {count} calls past --env-timeout-seconds have not returned "
            f"(blocking code a timeout cannot stop, e.g. time.sleep in an async step); the run "
            f"ends rather than keep more than {MAX_STRANDED} stranded threads", "stranded")


class EnvWorker:
    """A daemon thread running an event loop of its own, for one environment instance.

    Build it, :meth:`call` it from the caller's event loop, :meth:`close` it when the episode
    ends (never blocks). Not for use from its own thread.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._busy = 0  # calls submitted whose coroutine has not ended (guarded by _lock)
        self._stranded = False
        self._closed = False
        self.thread = threading.Thread(target=self._run, name=f"replayrl-env-{next(_ids)}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        global _stranded
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:  # what close() left: cancel it and let it unwind
                task.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            with _lock:
                if self._stranded:
                    _stranded -= 1

    async def call(self, make: Callable[[], Awaitable[T]], timeout_s: float | None) -> T:
        """``await make()`` on this worker's loop; the caller's loop waits without running it.

        Args:
            make: builds the coroutine (called on the worker's thread, so a blocking
                constructor or a synchronous part of the call blocks only that thread).
            timeout_s: seconds to wait, > 0; ``None``: no limit.
        Returns:
            what the coroutine returned.
        Raises:
            asyncio.TimeoutError: no answer within ``timeout_s`` (the call is cancelled; code
                that blocks ends its work when it returns).
            RuntimeError: the worker is closed.
            CallExited: the coroutine raised ``SystemExit`` or another ``BaseException`` that
                is not an ``Exception`` (its cause).
            Whatever else the coroutine raised.
        """
        if self._closed:
            raise RuntimeError("the environment worker is closed")

        async def run() -> T:
            try:
                return await make()
            except (asyncio.CancelledError, Exception):
                raise
            except BaseException as exc:  # sys.exit() in a step must not end the run
                raise CallExited(f"{type(exc).__name__}: {exc}") from exc
            finally:  # here, not on the future: a cancelled future says nothing of the thread
                with _lock:
                    self._busy -= 1

        with _lock:
            self._busy += 1
        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        # cancelling the wrapped future (a timeout, or the caller cancelled) cancels the task
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)

    def close(self) -> None:
        """Stop the loop once its current work returns; a worker with a call still running is
        counted stranded (:func:`stranded`) until it does. Idempotent; never blocks."""
        global _stranded
        if self._closed:
            return
        self._closed = True
        with _lock:
            if self._busy and self.thread.is_alive():
                self._stranded = True
                _stranded += 1
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # its loop is closed already
            pass
