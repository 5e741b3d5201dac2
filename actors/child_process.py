"""Fresh Python child processes started with ``subprocess``, for the actors and the launcher's
initial-files child.

``multiprocessing``'s ``spawn`` start method does the same job, and more than replayrl needs: its
first start launches a *resource tracker* process that lives as long as the launcher (~14 MiB
RSS), and every child imports the parent's ``__main__`` module again (``__mp_main__``). Here a
child is ``python -c`` with a short bootstrap (``_ENTRY``) that drops the working directory from
``sys.path``, reads the parent's ``sys.path`` from its stdin (before it imports anything from the
working directory or replayrl), then calls :func:`child_main`, which reads the call to make
(a function of an importable module, not ``__main__``, and its arguments, pickled) from its
stdin, which is then ``/dev/null``, as under ``spawn``. It inherits the environment, working
directory, stdout and stderr.

:class:`ChildProcess` answers what the :class:`replayrl.actors.Supervisor` asks of a process
with ``multiprocessing.Process``'s names: ``pid``, ``exitcode`` (``-N`` after signal ``N``),
``join``, ``terminate``, ``kill`` and ``sentinel``, an fd that turns readable once the child
has exited (a pipe whose other end only the child holds).
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import traceback
import weakref
from typing import Any, Callable, TypeVar

from replayrl.actors.errors import ActorDied, RemoteError

T = TypeVar("T")

# `python -c` puts the working directory first on sys.path: drop it before any import (a
# `secrets.py` there must not shadow the stdlib), then take the parent's sys.path, so a replayrl
# importable only through it (PYTHONPATH set at runtime, a test's path) is found
_ENTRY = ("import sys; del sys.path[0]; import pickle; sys.path[:] = pickle.load(sys.stdin.buffer); "
          "from replayrl.actors.child_process import child_main; child_main()")
_live: weakref.WeakSet[ChildProcess] = weakref.WeakSet()


class ChildProcess:
    """A running child (:func:`start_child`), with ``multiprocessing.Process``'s process API.

    Attributes:
        name: a label for logs and ``repr`` (the process's own title is set by its target).
        pid: the child's process id.
        sentinel: read end of a pipe the child holds the other end of: readable (EOF) once the
            child has exited; for ``loop.add_reader`` / ``select``.
    """

    def __init__(self, popen: subprocess.Popen, sentinel: int, name: str) -> None:
        self._popen = popen
        self.sentinel = sentinel
        self.name = name
        self.pid = popen.pid
        _live.add(self)

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status, or ``-N`` when signal ``N`` ended it."""
        code = self._popen.poll()
        if code is not None:
            _live.discard(self)
        return code

    def is_alive(self) -> bool:
        """Whether it still runs."""
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait until it exits, or ``timeout`` seconds (then return with it still running)."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return
        _live.discard(self)

    def terminate(self) -> None:
        """SIGTERM, unless it has exited."""
        if self.exitcode is None:
            self._popen.terminate()

    def kill(self) -> None:
        """SIGKILL, unless it has exited."""
        if self.exitcode is None:
            self._popen.kill()

    def send_signal(self, sig: int) -> None:
        """Send signal ``sig``, unless it has exited: once reaped, its pid may already belong to
        an unrelated process, which a bare ``os.kill(pid, sig)`` would hit."""
        if self.exitcode is None:
            self._popen.send_signal(sig)

    def close(self) -> None:
        """Close the sentinel (after the exit was seen; the object then only answers
        ``exitcode``)."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1

    def __del__(self) -> None:
        # the sentinel stays open while the object lives: a watcher may select on it after exit
        try:
            self.close()
        except (OSError, AttributeError):
            pass

    def __repr__(self) -> str:
        return f"<ChildProcess {self.name} pid={self.pid} exitcode={self.exitcode}>"


def live_children() -> list[ChildProcess]:
    """The children :func:`start_child` started in this process that have not been seen to
    exit (``multiprocessing.active_children``'s counterpart)."""
    return [c for c in list(_live) if c.exitcode is None]


def start_child(target: Callable[..., Any], args: tuple = (), *, name: str = "child",
                pass_fds: tuple[int, ...] = ()) -> ChildProcess:
    """Start ``target(*args)`` in a fresh Python process; returns at once.

    ``target`` is a function of an importable module (not ``__main__``) and ``args`` pickle.
    ``pass_fds``: fds the child inherits (same numbers; not inheritable further, so a process the
    child starts with ``exec`` does not hold them). The child exits 0 when ``target`` returns, 1
    (traceback on stderr) when it raises.

    Raises:
        pickle.PicklingError / TypeError / AttributeError: ``target`` or ``args`` do not pickle
            (nothing started).
        OSError: the interpreter could not be started.
    """
    alive_r, alive_w = os.pipe()
    try:
        payload = pickle.dumps(list(sys.path)) + pickle.dumps((target, args, (alive_w, *pass_fds)))
        popen = subprocess.Popen(
            [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", _ENTRY],
            stdin=subprocess.PIPE, pass_fds=(alive_w, *pass_fds), close_fds=True)
    except BaseException:
        os.close(alive_r)
        raise
    finally:
        os.close(alive_w)  # the child's copy alone keeps the pipe open
    try:
        popen.stdin.write(payload)
    except BrokenPipeError:  # it died at once: its exit code tells
        pass
    finally:
        try:
            popen.stdin.close()
        except BrokenPipeError:
            pass
    return ChildProcess(popen, alive_r, name)


def child_main() -> None:
    """The child's side of :func:`start_child`, after ``_ENTRY`` set ``sys.path``: read the call
    from stdin, make the call. Not for direct use."""
    target, args, fds = pickle.load(sys.stdin.buffer)  # (sys.path: read by _ENTRY)
    for fd in fds:
        os.set_inheritable(fd, False)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # fd 0 too, not only sys.stdin: the spent pipe goes
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's stdin for its whole life)
    target(*args)


def _answer(fd: int, fn: Callable[..., Any], args: tuple,
            initializer: Callable[[], None] | None) -> None:
    """In the child of :func:`run_in_child`: ``fn(*args)``'s result or exception, pickled to
    ``fd``."""
    try:
        if initializer is not None:
            initializer()
        out: tuple = (True, fn(*args))
    except BaseException as exc:  # noqa: BLE001 (the parent re-raises it)
        out = (False, exc, type(exc).__qualname__, str(exc), traceback.format_exc())
    try:
        data = pickle.dumps(out)
    except Exception as exc:  # an unpicklable result or exception: its type, message and text
        data = pickle.dumps((False, None, *(out[2:] if not out[0] else
                                            (type(exc).__qualname__, str(exc), traceback.format_exc()))))
    with os.fdopen(fd, "wb") as pipe:
        pipe.write(data)


def run_in_child(fn: Callable[..., T], *args: Any,
                 initializer: Callable[[], None] | None = None) -> T:
    """``fn(*args)`` in a fresh Python process (:func:`start_child`), which exits when it
    returns; ``initializer()`` runs there first. ``fn`` is a module-level function, ``args``
    and the result pickle.

    Raises:
        whatever ``fn`` raised, re-raised here;
        replayrl.actors.errors.RemoteError: its exception (or result) does not pickle (its
            type, message and traceback text);
        replayrl.actors.errors.ActorDied: the child died without answering (its exit code).
        KeyboardInterrupt: the child died of SIGINT without answering (Ctrl-C while it started).
    """
    result_r, result_w = os.pipe()
    try:
        child = start_child(_answer, (result_w, fn, args, initializer),
                            name=getattr(fn, "__name__", "child"), pass_fds=(result_w,))
    except BaseException:
        os.close(result_r)
        raise
    finally:
        os.close(result_w)
    try:
        with os.fdopen(result_r, "rb") as pipe:
            data = pipe.read()
        child.join()
    except BaseException:  # interrupted (Ctrl-C, SIGTERM's handler): the child goes too
        child.kill()
        child.join()
        raise
    finally:
        child.close()
    if not data:
        if child.exitcode == -signal.SIGINT:
            # Ctrl-C reaches the whole process group: a child still starting (importing,
            # before it can answer) dies of it, and the parent's own interrupt, which the
            # event loop only turns into a cancellation at its next await, would otherwise
            # end the run as this child's death (exit 1) instead of an interrupt (130)
            raise KeyboardInterrupt(f"child process of {fn.__qualname__} interrupted")
        raise ActorDied(f"child process of {fn.__qualname__}", child.exitcode,
                        "exited without an answer")
    ok, value, *text = pickle.loads(data)
    if ok:
        return value
    if value is None:
        raise RemoteError(f"child process of {fn.__qualname__}", fn.__qualname__, *text)
    raise value
