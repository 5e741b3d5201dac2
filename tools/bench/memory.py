"""``replayrl bench memory``: peak memory of a ``replayrl train`` process tree, two sides compared.

The two sides are this checkout against ``--baseline REV`` (a git revision, checked out into a
temporary worktree as ``replayrl bench steps`` does), or this checkout with the run's flags
against the same with ``--variant FLAGS`` added (e.g. ``--variant=--colocate``), or both (the
baseline with the run's flags against this checkout with the variant's). The sides run
alternately (A, B, A, B, ...; ``--runs`` each), each a fresh ``replayrl train`` process tree as a
user starts it, sampled every ``--interval`` seconds from ``/proc``
(:func:`replayrl.tools.bench.tree_memory.run_sampled`).

Printed per side, as medians over its runs: the tree's peak summed RSS and PSS (MiB), the wall
seconds of the run, and each process's peak RSS / PSS by its ``comm`` name (``rrl:NAME`` for an
actor, :mod:`replayrl.actors.process_title`; the launcher shows as ``replayrl`` or ``python``);
then the ratio B / A of every figure. RSS counts a library page once per process that maps it,
PSS splits it between them (:mod:`replayrl.tools.bench.tree_memory`).
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from replayrl.tools.bench import ab_runs
from replayrl.tools.bench.source_tree import train_command
from replayrl.tools.bench.tree_memory import run_sampled
from replayrl.tools.bench.usage import bench_parser, train_refusal
from replayrl.tools.errors import BenchError

MIB = 1024 * 1024


@dataclass(frozen=True)
class MemoryRun:
    """One run's figures: tree peaks and per-process peaks in MiB, wall seconds."""

    peak_rss_mib: float
    peak_pss_mib: float
    seconds: float
    by_process: dict[str, tuple[float, float]]


def run_once(tree: Path, output_dir: Path, steps: int, flags: Sequence[str],
             interval: float) -> MemoryRun:
    """One ``replayrl train`` from checkout ``tree`` with ``flags``, its tree sampled.

    Raises:
        ConfigError: the run refused the flags (exit 2; its one-line reason).
        BenchError: the run failed otherwise (its last output lines in the message).
    """
    argv, env = train_command(tree, output_dir, steps, flags)
    start = time.perf_counter()
    proc, memory = run_sampled(argv, env, interval)
    seconds = time.perf_counter() - start
    if (refused := train_refusal(proc.returncode, proc.stdout + proc.stderr)) is not None:
        raise refused
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise BenchError(f"replayrl train {' '.join(flags)} from {tree} exited "
                         f"{proc.returncode}:\n{tail}")
    return MemoryRun(memory.peak_rss_bytes / MIB, memory.peak_pss_bytes / MIB, seconds,
                     {name: (r / MIB, p / MIB) for name, (r, p) in memory.by_process.items()})


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _cell(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or a <= 0 else f"{b / a:.2f}"


def table(label_a: str, label_b: str, runs_a: list[MemoryRun], runs_b: list[MemoryRun]) -> str:
    """Markdown table of the medians over each side's runs and the ratios B / A.

    Rows: tree peak RSS and PSS (MiB), wall seconds, then per process name (sorted) its peak
    RSS and PSS; a process one side never ran shows ``n/a`` there.
    """
    rows = [("tree peak RSS, MiB", [r.peak_rss_mib for r in runs_a], [r.peak_rss_mib for r in runs_b], 0),
            ("tree peak PSS, MiB", [r.peak_pss_mib for r in runs_a], [r.peak_pss_mib for r in runs_b], 0),
            ("wall seconds", [r.seconds for r in runs_a], [r.seconds for r in runs_b], 1)]
    names = sorted({n for r in runs_a + runs_b for n in r.by_process})
    for name in names:
        for i, what in enumerate(("RSS", "PSS")):
            rows.append((f"`{name}` peak {what}, MiB",
                         [r.by_process[name][i] for r in runs_a if name in r.by_process],
                         [r.by_process[name][i] for r in runs_b if name in r.by_process], 0))
    lines = [f"| figure | A: {label_a} | B: {label_b} | B / A |", "|---|---:|---:|---:|"]
    for label, a, b, digits in rows:
        ma, mb = _median(a), _median(b)
        lines.append(f"| {label} | {_cell(ma, digits)} | {_cell(mb, digits)} | {_ratio(ma, mb)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: prints the settings and the table on stdout; 2 on a bad setting."""
    parser = bench_parser("memory", __doc__)
    ab_runs.add_flags(parser, runs=3)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--interval", type=float, default=0.25,
                        help="seconds between two samples of the process tree's memory")
    args = parser.parse_args(argv)
    ab = ab_runs.sides(parser, args)
    if args.runs < 1 or args.steps < 1 or args.interval <= 0:
        parser.error("need --runs >= 1, --steps >= 1 and --interval > 0")
    try:
        runs_a, runs_b = ab_runs.alternate(
            ab, args.runs, args.priority, "replayrl-bench-memory-",
            lambda tree, out, flags: run_once(tree, out, args.steps, flags, args.interval))
    except BenchError as exc:
        print(f"replayrl bench memory: {exc}", file=sys.stderr)
        return 2
    print(f"replayrl train --num-steps {args.steps} {' '.join(ab.flags_a)}; A: {ab.label_a}, "
          f"B: {ab.label_b}; {args.runs} run(s) per side, alternated; sampled every {args.interval} s; "
          f"medians over runs{'; --priority' if args.priority else ''}\n")
    print(table(ab.label_a, ab.label_b, runs_a, runs_b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
