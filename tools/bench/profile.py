"""``replayrl bench profile``: where one step's time goes, per actor process and per phase.

Runs the real multi-process system for ``--steps`` steps with ``REPLAYRL_PROFILE_DIR`` set, so
every actor process runs under cProfile while it serves (``actors/profiling.py``) and writes
``<name>.prof`` / ``<name>.txt`` into ``--output-dir/profile``. Prints:

1. the per-step time breakdown from ``metrics.jsonl`` (median of every ``*_seconds`` key over
   the steps after the first ``--warmup``);
2. per actor, the functions with the most own time (cProfile ``tottime``), per step.

Extra flags after ``--`` go to the run (``replayrl bench profile -- --engine-dtype bfloat16``).
Profiling slows Python-heavy code down, so the breakdown of (1) is taken from the same run but
reads higher than an unprofiled run; use it for proportions.
"""
from __future__ import annotations

import argparse
import os
import pstats
import statistics
from pathlib import Path

from replayrl.actors.profiling import PROFILE_ENV
from replayrl.tools.bench.usage import bench_parser


def breakdown(rows: list[dict], warmup: int) -> dict[str, float]:
    """Median of every ``*_seconds`` key over ``rows[warmup:]`` (all rows when fewer remain)."""
    steady = rows[warmup:] or rows
    keys = sorted({k for r in steady for k in r if k.endswith("_seconds")})
    return {k: statistics.median(r[k] for r in steady if k in r) for k in keys}


def top_functions(prof: Path, steps: int, top: int) -> list[tuple[str, float, int]]:
    """``(function, own seconds per step, calls per step)`` of the ``top`` highest own times."""
    stats = pstats.Stats(str(prof)).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [(f"{Path(f).name}:{line}({name})" if f != "~" else name, tt / steps, nc // steps)
            for (f, line, name), (cc, nc, tt, ct, callers) in rows]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: runs the profiled training and prints the report."""
    parser = bench_parser("profile", __doc__)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of the profiled run")
    parser.add_argument("--warmup", type=int, default=5,
                        help="first steps left out of the time breakdown")
    parser.add_argument("--top", type=int, default=12,
                        help="functions listed per actor, most own time first")
    parser.add_argument("--output-dir", default="runs/profile",
                        help="the run's --output-dir; the profiles go to its profile/")
    parser.add_argument("--priority", action="store_true",
                        help="on a machine shared with other users' jobs, run first "
                             "(Linux autogroup nice -20; needs root)")
    parser.add_argument("run_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_FLAGS",
                        help="replayrl train flags for the run, after --")
    args = parser.parse_args(argv)
    from replayrl.actors import run_event_loop
    from replayrl.tools.run.flags import add_run_flags
    from replayrl.tools.run.from_flags import config_from_args
    from replayrl.tools.run.launcher import launch

    run_args = [a for a in args.run_args if a != "--"]
    train_flags = argparse.ArgumentParser(prog="replayrl bench profile -- (train flags)")
    add_run_flags(train_flags)
    config = config_from_args(train_flags.parse_args(
        ["--num-steps", str(args.steps), "--no-progress", "--output-dir", args.output_dir,
         "--overwrite", *run_args]))  # a profile taken again replaces the earlier run
    profile_dir = Path(args.output_dir) / "profile"
    os.environ[PROFILE_ENV] = str(profile_dir)  # inherited by every spawned actor process
    from replayrl.tools.bench.priority import autogroup_priority

    try:
        with autogroup_priority(args.priority):
            result = run_event_loop(launch(config))
    finally:
        os.environ.pop(PROFILE_ENV, None)
    print(f"{args.steps} steps, breakdown = median over steps {args.warmup}.. (seconds):")
    for key, value in breakdown(result.rows, args.warmup).items():
        print(f"  {key:40s} {value:.4f}")
    for prof in sorted(profile_dir.glob("*.prof")):
        print(f"\n{prof.stem}: top {args.top} by own time, per step (full text: "
              f"{prof.with_suffix('.txt')})")
        for name, seconds, calls in top_functions(prof, args.steps, args.top):
            print(f"  {seconds * 1e3:8.2f} ms  {calls:6d} calls  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
