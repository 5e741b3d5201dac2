"""Serving actors in this process: each actor started (``on_start``), served under its own name
and endpoint until ``__stop__`` (or until the parent process is gone), then stopped
(``on_stop``); one actor, several in one event loop, or several loops in threads of their own
(docs/design/actors.md#colocate). With ``REPLAYRL_PROFILE_DIR`` each loop runs under cProfile
(:mod:`replayrl.actors.profiling`).
"""
from __future__ import annotations

import asyncio
import cProfile
import logging
import os
import threading
import traceback
from typing import Any, Callable

from replayrl.actors.actor import Actor, ActorServer
from replayrl.actors.directory import Directory
from replayrl.actors.loop import run_event_loop
from replayrl.actors.profiling import PROFILE_ENV, write_profile
from replayrl.actors.ref import close_connections, use_curve_keys, use_heartbeat_deadline, use_shared_memory

log = logging.getLogger(__name__)
_PARENT_POLL_SECONDS = 0.5


async def serve_actor(actor: Actor, name: str, directory: Directory,
                      parent_pid: int | None = None) -> str:
    """Run ``actor`` under ``name`` until ``__stop__`` (or until the parent process is gone).

    Returns:
        ``""``, or the failure ``__stop__`` was given (a torchrun driver stopping its ranks
        after the run failed: tools/run/torchrun_entry.py).
    """
    use_directory(directory)
    profile_dir = os.environ.get(PROFILE_ENV)
    try:
        return await serve_until_stopped(actor, name, directory, parent_pid,
                            cProfile.Profile() if profile_dir else None, profile_dir)
    finally:
        close_connections()


async def serve_actors(members: list[tuple[Actor, str]], directory: Directory,
                       parent_pid: int | None = None, process: str = "") -> list[str]:
    """Serve several actors in this process's one event loop, each ``(actor, name)`` under its
    own name and endpoint, as :func:`serve_actor` serves one: each starts (``on_start``) and
    serves on its own, answers its own calls, pings and ``__stop__``, and stops on its own;
    returns once every one has stopped (or the parent process is gone), with each one's
    failure (``""`` or what its ``__stop__`` was given), in order. One member only: exactly
    :func:`serve_actor`.

    ``process``: the name the process's profile is written under (``REPLAYRL_PROFILE_DIR``;
    one profile for the whole process, from before the first ``on_start`` until every member
    stopped).

    Raises:
        Whatever a member's ``on_start`` / ``on_stop`` raised (the others are cancelled when
        the event loop ends).
    """
    if len(members) == 1:
        return [await serve_actor(*members[0], directory, parent_pid)]
    use_directory(directory)
    return await _serve_loop(members, directory, parent_pid, process, this_loop_only=False)


def serve_in_threads(loops: list[list[tuple[Actor, str]]], directory: Directory,
                     parent_pid: int | None, on_error: Callable[[str], Any]) -> list[str]:
    """Serve each list of ``(actor, name)`` of ``loops`` on an event loop of its own, in a thread
    of its own (as :func:`serve_actors` serves them, in its loop), until every actor stopped;
    returns each actor's failure text, in order. The process-wide connection settings are made
    once, here; each loop closes only its own connections. With ``REPLAYRL_PROFILE_DIR`` each
    loop writes its own profile, named by its actors (``a+b``).

    ``on_error(traceback_text)`` is called in the thread of a loop that raised (an ``on_start`` /
    ``on_stop`` error); it should end the process (the spawned child writes the traceback and
    exits), else that loop's actors are just gone.
    """
    use_directory(directory)
    failures: list[list[str]] = [[] for _ in loops]

    def run(i: int) -> None:
        try:
            failures[i] = run_event_loop(_serve_loop(loops[i], directory, parent_pid))
        except BaseException:
            on_error(traceback.format_exc())

    threads = [threading.Thread(target=run, args=(i,), daemon=True,
                                name=f"replayrl-{'+'.join(n for _, n in members)}")
               for i, members in enumerate(loops)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [f for loop in failures for f in loop]


async def _serve_loop(members: list[tuple[Actor, str]], directory: Directory,
                      parent_pid: int | None, profile_name: str = "",
                      this_loop_only: bool = True) -> list[str]:
    """``members`` served together on the running loop, under one profile (named
    ``profile_name``, else by the members ``a+b``); then the loop's connections are closed: only
    its own (``this_loop_only``: one of :func:`serve_in_threads`' threads) or every one of the
    process (:func:`serve_actors`, the process's only loop)."""
    profile_dir = os.environ.get(PROFILE_ENV)
    profile = cProfile.Profile() if profile_dir else None
    if profile is not None:
        profile.enable()
    try:
        return list(await asyncio.gather(*(serve_until_stopped(actor, name, directory, parent_pid)
                                           for actor, name in members)))
    finally:
        if profile is not None:
            profile.disable()
            write_profile(profile, profile_dir, profile_name or "+".join(n for _, n in members))
        close_connections(this_loop_only=this_loop_only)


def use_directory(directory: Directory) -> None:
    """This process's connections use the run's CURVE keys, heartbeat deadline and shared memory
    (process-wide settings of :mod:`replayrl.actors.ref`; call before the first connection)."""
    use_curve_keys(directory.keys())
    use_heartbeat_deadline(directory.heartbeat_deadline_s)
    use_shared_memory(*directory.shm)


async def serve_until_stopped(actor: Actor, name: str, directory: Directory, parent_pid: int | None,
                              profile: cProfile.Profile | None = None, profile_dir: str | None = None) -> str:
    """Start ``actor`` (``on_start``) and serve it under ``name`` until ``__stop__`` or, where
    ``parent_pid`` is given, until this process's parent is no longer that process; then stop it
    (``on_stop``). Leaves this process's connections open (the caller closes them).

    Args:
        profile: enabled once it serves and written to ``profile_dir`` under ``name`` when it
            stops; None where the caller profiles the whole loop.
    Returns:
        ``""``, or the failure text its ``__stop__`` was given.
    Raises:
        Whatever ``on_start`` / ``on_stop`` raised.
    """
    actor.name, actor.directory = name, directory
    await actor.on_start()
    server = ActorServer(actor, directory.endpoint(name), curve=directory.keys())
    if profile is not None:
        profile.enable()
    server.start()
    try:
        while not server.stopped.is_set():
            try:
                await asyncio.wait_for(server.stopped.wait(), _PARENT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if parent_pid is not None and os.getppid() != parent_pid:
                    log.warning("%s: parent %d is gone; stopping", name, parent_pid)
                    break
        await asyncio.sleep(0.05)  # let the reply to __stop__ leave the socket
        return server.failure
    finally:
        if profile is not None:
            profile.disable()
            write_profile(profile, profile_dir, name)
        try:
            await actor.on_stop()
        finally:
            server.close()
