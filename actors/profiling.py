"""Per-process cProfile of the actors, switched on by ``REPLAYRL_PROFILE_DIR``.

With ``REPLAYRL_PROFILE_DIR`` set in the environment, every actor process runs under cProfile
from the moment it serves until it stops and then writes ``<dir>/<name>.prof`` (``pstats``
data) and ``<dir>/<name>.txt`` (the top entries by own time and by cumulative time); ``replayrl
bench profile`` uses it. A process of several actors writes one profile, named by its
``process`` (:mod:`replayrl.actors.serve` and :mod:`replayrl.actors.driver` do the profiling).
"""
from __future__ import annotations

import cProfile
import io
import pstats
from pathlib import Path

PROFILE_ENV = "REPLAYRL_PROFILE_DIR"
"""Environment variable: a directory where every actor process writes its cProfile."""


def write_profile(profile: cProfile.Profile, directory: str | Path, name: str,
                  top: int = 25) -> Path:
    """Write ``<directory>/<name>.prof`` and a text summary ``<name>.txt``; returns the text's path.

    The summary lists the ``top`` functions by own time (``tottime``) and by cumulative time.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    profile.dump_stats(str(out / f"{name}.prof"))
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    path = out / f"{name}.txt"
    path.write_text(text.getvalue())
    return path
