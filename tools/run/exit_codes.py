"""How a replayrl command ends, as a process exit code — one mapping for every entry point.

``replayrl train``, ``replayrl repl``, ``replayrl bench`` and each rank of
``replayrl.tools.run.torchrun_entry`` run their body through :func:`exit_code`:

====  =================================================================================
code  meaning
====  =================================================================================
0     the body returned 0 (or the code it returned)
1     the run failed: an actor died or raised (its traceback is part of the message)
2     configuration error (:class:`replayrl.tools.run.config.ConfigError`), before or after start
3     a torchrun rank lost its driver (link cut, host or driver gone) and left on its own
      (:mod:`replayrl.tools.run.driver_watch`)
130   Ctrl-C (``KeyboardInterrupt``); every actor was stopped on the way out
143   SIGTERM (timeout, slurm, k8s) once :func:`handle_sigterm` is installed
====  =================================================================================
"""
from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any, Awaitable, Callable, TypeVar

from replayrl.tools.errors import ConfigError, Terminated

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
EXIT_DRIVER_LOST = 3
T = TypeVar("T")


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def handle_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (call from the main thread).

    Not for the REPL: its console catches ``KeyboardInterrupt`` (and so ``Terminated``) and
    goes on, so there SIGTERM keeps its default action.
    """
    signal.signal(signal.SIGTERM, _on_sigterm)


async def until_terminated(work: Awaitable[T]) -> T:
    """Await ``work`` in the running event loop (on the main thread); a SIGTERM meanwhile
    cancels it, as Ctrl-C cancels ``asyncio.run``'s main task, and raises :class:`Terminated`
    once its ``finally`` blocks ran (every actor stopped).

    :func:`handle_sigterm`'s handler alone would raise :class:`Terminated` in whatever frame
    the loop was running, often another task (an actor served in this process), where it ends
    that task with an unretrieved exception instead of unwinding the run. Outside this call the
    handler that was installed (:func:`handle_sigterm`'s) applies again.

    Raises:
        Terminated: SIGTERM arrived while ``work`` ran.
        Whatever ``work`` raised.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    signalled: list[Any] = []

    def cancel() -> None:
        signalled.append(True)
        task.cancel()

    previous = signal.getsignal(signal.SIGTERM)
    loop.add_signal_handler(signal.SIGTERM, cancel)
    try:
        return await task
    except asyncio.CancelledError:
        if signalled:
            raise Terminated() from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)


def exit_code(body: Callable[[], int | None], *, prog: str = "replayrl",
              failure: str = "run failed",
              failures: tuple[type[Exception], ...] = (Exception,)) -> int:
    """Run ``body()`` and return the process exit code of how it ended (table above).

    Prints one line to stderr for every ending but success: ``{prog}: configuration error:
    ...``, ``{prog}: interrupted; all actors stopped``, ``{prog}: terminated; all actors
    stopped`` or ``{prog}: {failure}: {type}: {message}``.

    Args:
        body: the command; returns its exit code (``None`` counts as 0).
        prog: prefix of the printed line (``"replayrl[rank 2]"`` for a torchrun rank).
        failure: what failed, for exit code 1 (``"actors failed to start"`` in the REPL).
        failures: exceptions mapped to exit code 1; others propagate with their traceback
            (``()`` for benchmarks, whose tracebacks are the useful output).
    Returns:
        0 / the body's code, 1, 2, 130 or 143.
    Raises:
        whatever ``body`` raises outside ``failures``, ``ConfigError`` and ``KeyboardInterrupt``.
    """
    try:
        return body() or EXIT_OK
    except Terminated:
        print(f"{prog}: terminated; all actors stopped", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; all actors stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except failures as exc:  # an actor's traceback is part of the message
        print(f"{prog}: {failure}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
