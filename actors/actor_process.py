"""What an actor process does, from the moment it starts (:mod:`replayrl.actors.child_process`
starts a fresh interpreter and calls :func:`actor_process_main`) until it exits.

Each actor runs in a fresh Python process (no inherited torch / ZeroMQ state) with its own event
loop (uvloop when installed), unless specs name one ``process`` for several actors: those share
one process and its event loop, each served under its own name and endpoint
(docs/design/actors.md#colocate). The child ignores SIGINT, so Ctrl-C reaches only the launcher, which
then stops every actor in order; a child also exits by itself within about a second when its
parent disappears, so no process outlives the run. A child that dies writes its traceback to
``<run_dir>/<name>.traceback`` (a shared process: ``<process>.traceback``) for the supervisor to
report. SIGUSR1 prints every thread's Python stack to stderr (:mod:`faulthandler`): the
supervisor sends it to an actor that did not start in time, before it stops it.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import traceback
from pathlib import Path

from replayrl.actors.directory import Directory
from replayrl.actors.loop import run_event_loop
from replayrl.actors.objects import import_actor_class
from replayrl.actors.process_title import set_process_title
from replayrl.actors.run_dir import leave_run_dir
from replayrl.actors.serve import serve_actors, serve_in_threads
from replayrl.actors.spec import ActorSpec


def actor_process_main(specs: tuple[ActorSpec, ...], endpoints: dict[str, str], curve_keys: str,
                       heartbeat_deadline_s: float, shm: tuple[int, int], parent_pid: int, run_dir: str,
                       log_level: int, run_name: str) -> None:
    """One actor process (the target :class:`~replayrl.actors.supervisor.Supervisor` starts):
    build the actors of ``specs`` (one process, :func:`~replayrl.actors.spec.process_groups`) in
    order, serve them until each stopped; a failure writes ``<run_dir>/<process>.traceback`` and
    exits with status 1. Never raises.

    Args:
        endpoints, curve_keys, heartbeat_deadline_s, shm: the run's
            :class:`~replayrl.actors.directory.Directory`, as its parts (they pickle).
        parent_pid: the launcher's pid; once this process's parent is another, it stops.
        run_name: the run in the process title; empty: ``run_dir``.
    """
    key = specs[0].process_key
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C
    # a start that hangs can be located: the supervisor's SIGUSR1 prints every thread's stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    set_process_title(key, run_name or run_dir)
    for spec in specs:
        os.environ.update(spec.env)
    if specs[0].cpus:
        os.sched_setaffinity(0, specs[0].cpus)
    logging.basicConfig(level=log_level, format=f"%(asctime)s {key} %(levelname)s %(message)s")

    def die(text: str) -> None:
        try:
            Path(run_dir, f"{key}.traceback").write_text(text)
        finally:
            sys.stderr.write(f"[{key}] died:\n{text}")
            sys.stderr.flush()
            os._exit(1)

    try:
        members = [(import_actor_class(spec.cls)(**spec.kwargs), spec.name) for spec in specs]
        directory = Directory(endpoints, curve_keys, heartbeat_deadline_s, shm)
        shared = [m for m, spec in zip(members, specs) if not spec.thread]
        own = [[m] for m, spec in zip(members, specs) if spec.thread]
        if len(members) > 1 and own:  # loops of their own: the members without thread share one
            serve_in_threads(([shared] if shared else []) + own, directory, parent_pid, die)
        else:
            run_event_loop(serve_actors(members, directory, parent_pid, key))
        if os.getppid() != parent_pid:  # the launcher was killed: nobody else will clean up
            leave_run_dir(run_dir)
    except BaseException:
        die(traceback.format_exc())
