"""The run directory: where a single-node run's ipc sockets and actor tracebacks live.

It sits in the system temp directory (a short path: AF_UNIX socket paths are limited to 107
bytes), mode 0700, named ``replayrl-<launcher pid>-<random>``. Normally the launcher removes it
when the run ends. A launcher killed with SIGKILL cannot: its actors notice the parent is gone
and exit by themselves, each removing its socket file, and the last one out removes the empty
directory (:func:`leave_run_dir`); whatever is still left (a traceback file, a race) is removed
by the next launcher's :func:`remove_stale_run_dirs`, which deletes this user's run directories
whose launcher process no longer exists.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["PREFIX", "create_run_dir", "leave_run_dir", "remove_stale_run_dirs"]

PREFIX = "replayrl-"


def create_run_dir(root: str | Path | None = None) -> Path:
    """A new run directory ``<root>/replayrl-<pid>-<random>`` (mode 0700), after removing stale
    ones (:func:`remove_stale_run_dirs`). ``root`` defaults to the system temp directory."""
    root = Path(root or tempfile.gettempdir())
    remove_stale_run_dirs(root)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale_run_dirs(root: str | Path | None = None) -> list[Path]:
    """Remove this user's run directories under ``root`` whose launcher is gone; returns them.
    Directories of other users and of live launchers are left alone."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid_text = path.name[len(PREFIX):].split("-", 1)[0]
        try:
            if not pid_text.isdigit() or path.stat().st_uid != os.getuid() or not path.is_dir():
                continue
        except OSError:
            continue
        if not _pid_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def leave_run_dir(run_dir: str | Path) -> None:
    """Called by an actor that exits because its launcher is gone: remove the run directory if
    it is empty by now (the last actor out succeeds; the others find their peers' files)."""
    try:
        os.rmdir(run_dir)
    except OSError:
        pass
