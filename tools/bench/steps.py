"""``replayrl bench steps``: the per-step time breakdown of this checkout against another commit
or another setting.

Checks ``--baseline`` (a git revision) out into a temporary worktree and runs ``replayrl train``
(``--steps`` steps, default settings plus the flags after ``--``) from the baseline tree and from
this checkout, alternated back to back (baseline, this, baseline, this, ...; ``--runs`` each), so
both see the same machine load. With ``--variant FLAGS`` this checkout's runs add those flags
(e.g. ``--variant "--engine-torch-threads 2"``); without ``--baseline`` the other side is this
checkout with the plain flags. Each run is a fresh process tree, exactly as a user runs it. For
every ``*_seconds`` key of ``metrics.jsonl`` (the per-step breakdown, docs/design/actors.md#actor-contract) it
prints the median over steps ``--warmup .. steps - 2`` of each run (the first steps warm up; the
last has no overlapping generation), the median of those over the runs, and the ratio this /
baseline. With ``--priority`` the runs go ahead of other sessions' jobs (:mod:`replayrl.tools.bench.priority`).

Needs ``git`` and a git checkout of replayrl; the baseline must accept the same flags.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from replayrl.tools.bench import ab_runs
from replayrl.tools.bench.profile import breakdown
from replayrl.tools.bench.source_tree import train_command
from replayrl.tools.bench.usage import bench_parser, train_refusal
from replayrl.tools.errors import BenchError
from replayrl.transport import strict_json


def run_medians(tree: Path, steps: int, warmup: int, output_dir: Path,
                extra: Sequence[str]) -> dict[str, float]:
    """One ``replayrl train`` from ``tree``; median of each ``*_seconds`` key over the steady steps.

    Raises:
        ConfigError: the run refused the flags (exit 2; its one-line reason).
        subprocess.CalledProcessError: the run failed otherwise (its output is shown).
    """
    argv, env = train_command(tree, output_dir, steps, extra)
    proc = subprocess.run(argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if (refused := train_refusal(proc.returncode, proc.stderr)) is not None:
        raise refused
    sys.stderr.write(proc.stderr)  # the run's own warnings, as when it wrote them itself
    proc.check_returncode()
    rows = [strict_json.loads(line) for line in
            (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return breakdown(rows[:-1], warmup)  # the last step has no overlapping generation


def table(baseline: str, before: list[dict[str, float]], after: list[dict[str, float]],
          this: str = "this checkout") -> str:
    """Markdown table: key | A: baseline | B: this | B / A (medians over runs)."""
    lines = [f"| key | A: {baseline} | B: {this} | B / A |", "|---|---:|---:|---:|"]
    for key in sorted({k for run in before + after for k in run}):
        b = [run[key] for run in before if key in run]
        a = [run[key] for run in after if key in run]
        if not a or not b:
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        ratio = f"{ma / mb:.2f}" if mb > 0 else "n/a"
        lines.append(f"| `{key}` | {mb:.4f} | {ma:.4f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: prints the table (and the runs' settings) on stdout."""
    parser = bench_parser("steps", __doc__)
    ab_runs.add_flags(parser, runs=2)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10,
                        help="first steps of each run left out of the medians")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.steps < 3 or not 0 <= args.warmup < args.steps - 1:
        parser.error("need --runs >= 1, --steps >= 3 and 0 <= --warmup < --steps - 1 (the "
                     "medians are over steps --warmup .. --steps - 2)")
    ab = ab_runs.sides(parser, args)
    try:
        before, after = ab_runs.alternate(
            ab, args.runs, args.priority, "replayrl-bench-steps-",
            lambda tree, out, flags: run_medians(tree, args.steps, args.warmup, out, flags))
    except BenchError as exc:
        print(f"replayrl bench steps: --baseline: {exc}", file=sys.stderr)
        return 2
    print(f"replayrl train --num-steps {args.steps} {' '.join(ab.flags_a)}; {args.runs} run(s) per side, "
          f"alternated; median over steps {args.warmup}..{args.steps - 2} per run, then over runs"
          f"{'; --priority' if args.priority else ''}"
          f"{'; this checkout adds ' + args.variant if args.variant else ''}\n")
    print(table(ab.label_a, before, after, ab.label_b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
