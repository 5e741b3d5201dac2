"""The two sides of a ``replayrl train`` A/B, shared by ``replayrl bench steps`` and ``replayrl
bench memory``.

Side A is a git revision (``--baseline``, checked out into a temporary worktree) or this
checkout; side B is this checkout with the ``--variant`` flags added; both take the flags after
``--``. The runs alternate A, B, A, B, ... (``--runs`` each), so both sides see the same machine
load, and run ahead of other sessions' jobs with ``--priority``.
"""
from __future__ import annotations

import argparse
import shlex
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from replayrl.tools.bench.priority import autogroup_priority
from replayrl.tools.bench.source_tree import checked_out

ROOT = Path(__file__).resolve().parents[2]
"""This checkout (side B, and side A without ``--baseline``)."""

T = TypeVar("T")


def add_flags(parser: argparse.ArgumentParser, runs: int) -> None:
    """Add ``--baseline``, ``--variant``, ``--runs`` (default ``runs``), ``--priority`` and the
    flags after ``--`` to ``parser``."""
    parser.add_argument("--baseline", default="", metavar="REV",
                        help="git revision of side A (default: this checkout)")
    parser.add_argument("--variant", default="", metavar="FLAGS",
                        help="flags side B adds, one quoted string (a single flag as "
                             "--variant=--colocate) (default: none, both sides run the same flags)")
    parser.add_argument("--runs", type=int, default=runs, help="runs of each side")
    parser.add_argument("--priority", action="store_true",
                        help="on a machine shared with other users' jobs, run first "
                             "(Linux autogroup nice -20; needs root)")
    parser.add_argument("run_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_FLAGS",
                        help="replayrl train flags for both sides, after --")


@dataclass(frozen=True)
class Sides:
    """What each side runs: ``baseline`` (side A's revision; empty: this checkout) and each
    side's ``replayrl train`` flags."""

    baseline: str
    flags_a: tuple[str, ...]
    flags_b: tuple[str, ...]

    @property
    def label_a(self) -> str:
        """Side A in a table header: its tree and flags."""
        return f"{self.baseline or 'this checkout'} {' '.join(self.flags_a)}".strip()

    @property
    def label_b(self) -> str:
        """Side B in a table header: this checkout and its flags."""
        return f"this checkout {' '.join(self.flags_b)}".strip()


def sides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Sides:
    """The :class:`Sides` of parsed ``args`` (flags of :func:`add_flags`); exits through
    ``parser.error`` (code 2) when neither ``--baseline`` nor ``--variant`` is given."""
    if not args.baseline and not args.variant:
        parser.error("give --baseline REV, --variant FLAGS or both: there is nothing to compare")
    flags = tuple(a for a in args.run_args if a != "--")
    return Sides(args.baseline, flags, (*flags, *shlex.split(args.variant)))


def alternate(ab: Sides, runs: int, priority: bool, prefix: str,
              run: Callable[[Path, Path, list[str]], T]) -> tuple[list[T], list[T]]:
    """``run(tree, output_dir, flags)`` for side A then side B, ``runs`` times; the results of
    each side in order. Output directories are fresh folders of a temporary directory.

    Raises:
        replayrl.tools.errors.BenchError: ``ab.baseline`` cannot be checked out.
        Whatever ``run`` raises.
    """
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp, \
            (checked_out(ROOT, ab.baseline) if ab.baseline else nullcontext(ROOT)) as tree_a:
        results_a: list[T] = []
        results_b: list[T] = []
        with autogroup_priority(priority):
            for i in range(runs):
                results_a.append(run(tree_a, Path(tmp) / f"a-{i}", list(ab.flags_a)))
                results_b.append(run(ROOT, Path(tmp) / f"b-{i}", list(ab.flags_b)))
    return results_a, results_b
