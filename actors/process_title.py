"""A title for each actor process, so ``ps``, ``top`` and ``pgrep`` tell the actors apart.

Every actor process is ``python -c 'import sys; ... child_main()'`` on its command line, and
every torchrun rank the same ``python -m replayrl.tools.run.torchrun_entry ...``; the title names the actor
and its run instead. Set with ``setproctitle`` (which rewrites the command line shown by
``ps -f`` / ``ps aux`` and, on Linux, the 15-character ``comm`` name that ``top``, ``ps -e``,
``pgrep`` and ``/proc/PID/comm`` show, through ``prctl(PR_SET_NAME)``).
"""
from __future__ import annotations

import setproctitle

COMM_PREFIX = "rrl:"
"""``comm`` is ``rrl:`` and the actor's name, cut at the kernel's 15 characters: ``pgrep rrl:``
finds every actor process, ``pgrep rrl:engine`` the engines."""


def process_title(actor: str, run: str) -> str:
    """The command-line title of actor ``actor`` of run ``run`` (its output or run directory):
    ``replayrl actor ACTOR run RUN``."""
    return f"replayrl actor {actor} run {run}"


def set_process_title(actor: str, run: str) -> None:
    """Retitle this process as actor ``actor`` of run ``run`` (:func:`process_title`) and its
    ``comm`` name as ``rrl:ACTOR`` (truncated by the kernel to 15 characters). Call once, in
    the actor's own process, before it serves."""
    setproctitle.setproctitle(process_title(actor, run))
    # setproctitle's own comm would be the title's first 15 characters, the same for every
    # actor ("replayrl actor "); the main thread's name is the process's comm
    setproctitle.setthreadtitle(f"{COMM_PREFIX}{actor}")
