"""Shared test helper: one actor served in the test's own process and event loop, as the
actor-runtime unit tests drive it (no launcher, no subprocess)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from replayrl.actors import Actor, Directory
from replayrl.actors.actor import ActorServer


@contextmanager
def serving(actor: Actor, name: str, run_dir: str | Path) -> Iterator[tuple[Directory, ActorServer]]:
    """Serve ``actor`` under ``name`` in a fresh run directory at ``run_dir`` (keep it short:
    the ipc endpoint's path counts against AF_UNIX's 107 bytes); yields ``(directory,
    server)`` and closes the server on exit (closing it again inside is harmless). Must be
    entered inside a running event loop."""
    directory = Directory.for_run(run_dir, [name])
    actor.name, actor.directory = name, directory
    server = ActorServer(actor, directory.endpoint(name))
    server.start()
    try:
        yield directory, server
    finally:
        server.close()
