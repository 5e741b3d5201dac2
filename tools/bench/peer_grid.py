"""``replayrl bench peer``: replayrl against Hugging Face TRL's ``GRPOTrainer`` with the same budget,
at one setting or (``--grid``) over model size x answer length.

This module is the command's entry (:func:`main`) and runs its ``--grid``. Every grid point is
one ``bench peer`` comparison (same ``checkpoint-init``, prompt ids, verifier, sampling and
optimizer settings and budget; :mod:`replayrl.tools.bench.peer`) at
``--model-size`` ``S`` (:func:`replayrl.rollout.model.config.embedded_config`) and ``N`` new tokens
per answer (``--rollout-max-response-len N`` on both sides; TRL's ``max_completion_length``).
Each side runs in its own child process (replayrl: its launcher and the actors it spawns; TRL:
one process), one after the other, alternating which goes first from point to point, and the
memory of each child's process tree is sampled from ``/proc``
(:mod:`replayrl.tools.bench.tree_memory`).

Answer length ``N`` counts the new tokens of a right answer, EOS included: ``N = 2`` is the
digits task (one digit and EOS); a longer ``N`` the sort task (``--task sort --answer-tokens
N-1``: N - 1 digits sorted, then EOS; :mod:`replayrl.rollout.tasks.sort`), both sides scoring
with its ``position_reward``. Nothing forces a policy to use all ``N`` (it may stop at EOS
early), so the measured mean answer length is printed beside every figure and the token rates
count the tokens actually generated.

Per point and side: completions/s, generated tokens/s, trainer tokens/s (prompt + completion
tokens of the step's samples / the trainer's seconds: replayrl's ``train_seconds``, TRL's step
seconds minus its seconds inside ``model.generate``), each the median over the steady-state
steps (:func:`replayrl.tools.bench.peer.warmup_steps`); peak summed RSS and PSS of the side's
process tree; the mean reward of the last ``--window`` steps; and the ratios replayrl / TRL. A
plot of the ratios over the grid goes to ``--output-dir/peer_grid.png``.

With several ``--seeds`` every point runs once per seed: the time to quality is printed per seed
and over seeds (each seed's ratio and the ratio of the mean seconds, :func:`seeds_table`); the
rates, memory and plots are the first seed's.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from replayrl.rollout.model.config import MODEL_SIZES
from replayrl.tools.bench.peer import (
    SideRun,
    _sha256,
    function_compared,
    median,
    ratio,
    run_config,
    run_replayrl,
    run_trl,
    same_function,
    settings_table,
    warmup_steps,
)
from replayrl.tools.bench.peer import (
    main as peer_main,
)
from replayrl.tools.bench.time_to_quality import (
    QUALITY_SHARE,
    TimeToQuality,
    plot_reward_curves,
    time_to_quality,
)
from replayrl.tools.bench.tree_memory import run_sampled
from replayrl.tools.errors import BenchError, ConfigError, PeerBenchError
from replayrl.transport import strict_json

GRIDS = {"quick": (("1m",), (2, 64)), "full": (MODEL_SIZES, (2, 64, 256))}
DEFAULT_STEPS = {"quick": 20, "full": 30}
MIB = 1024 * 1024


@dataclass(frozen=True)
class GridPoint:
    """One point of the grid: the embedded model's size preset and the new tokens per answer."""

    model_size: str
    answer_tokens: int

    def overrides(self) -> dict:
        """The run settings (flag name -> value) of this point: 2 tokens is the digits task;
        longer answers the sort task with ``answer_tokens - 1`` digits (then EOS)."""
        if self.answer_tokens == 2:
            return {"model-size": self.model_size, "rollout-max-response-len": 2}
        return {"model-size": self.model_size, "task": "sort", "answer-tokens": self.answer_tokens - 1,
                "rollout-max-response-len": self.answer_tokens}


def parse_grid(text: str) -> list[GridPoint]:
    """Grid points of ``--grid TEXT``: ``quick`` (1m x {2, 64}), ``full`` ({1m, 10m, 50m} x
    {2, 64, 256}) or ``SIZES:LENGTHS``, comma-separated (``1m,10m:2,64``), sizes outer.

    Raises:
        BenchError: an unknown name or size, a length < 2, a repeated entry, or no ``:``.
    """
    if text in GRIDS:
        sizes, lengths = GRIDS[text]
    else:
        if text.count(":") != 1:
            raise BenchError(f"--grid {text!r}: give quick, full or SIZES:LENGTHS (e.g. 1m,10m:2,64)")
        left, right = text.split(":")
        sizes = tuple(s.strip() for s in left.split(","))
        try:
            lengths = tuple(int(n) for n in right.split(","))
        except ValueError:
            raise BenchError(f"--grid {text!r}: answer lengths must be integers") from None
        bad = [s for s in sizes if s not in MODEL_SIZES]
        if bad:
            raise BenchError(f"--grid {text!r}: unknown model size {bad[0]!r} "
                             f"(known: {', '.join(MODEL_SIZES)})")
        if any(n < 2 for n in lengths):
            raise BenchError(f"--grid {text!r}: answer lengths must be >= 2 (a digit and EOS)")
        if len(set(sizes)) != len(sizes) or len(set(lengths)) != len(lengths):
            raise BenchError(f"--grid {text!r}: a size or length is repeated")
    return [GridPoint(s, n) for s in sizes for n in lengths]


def steady_rate(amounts: Sequence[float], seconds: Sequence[float]) -> float:
    """Median over the steady-state steps (after :func:`warmup_steps`) of ``amount / seconds``.

    Raises:
        ValueError: the two differ in length, or there is no step.
    """
    if len(amounts) != len(seconds):
        raise ValueError(f"{len(amounts)} amounts but {len(seconds)} step times")
    skip = warmup_steps(len(seconds))
    return median([a / s for a, s in zip(amounts[skip:], seconds[skip:])])


@dataclass(frozen=True)
class SideFigures:
    """The grid figures of one side at one point (rates per second, memory in bytes)."""

    completions_per_second: float
    generated_tokens_per_second: float
    trainer_tokens_per_second: float
    mean_answer_tokens: float
    peak_rss_bytes: int | None
    peak_pss_bytes: int | None
    final_reward: float


def side_figures(run: SideRun, window: int) -> SideFigures:
    """:class:`SideFigures` of ``run``; the reward is the mean over its last ``window`` steps
    (all steps when fewer).

    Raises:
        PeerBenchError: the run lacks per-step token counts or trainer seconds.
    """
    n = len(run.step_seconds)
    if not (len(run.generated_tokens) == len(run.trained_tokens) == len(run.train_seconds) == n):
        raise PeerBenchError(f"{run.side}: per-step tokens or trainer seconds missing")
    last = run.rewards[-min(window, n):]
    return SideFigures(
        steady_rate(run.completions, run.step_seconds),
        steady_rate(run.generated_tokens, run.step_seconds),
        steady_rate(run.trained_tokens, run.train_seconds),
        sum(run.generated_tokens) / sum(run.completions),
        run.peak_rss_bytes, run.peak_pss_bytes, sum(last) / len(last))


# (label, SideFigures field, format); the ratio column is replayrl / TRL
FIGURES = (("completions/s", "completions_per_second", ".0f"),
           ("generated tokens/s", "generated_tokens_per_second", ".0f"),
           ("trainer tokens/s", "trainer_tokens_per_second", ".0f"),
           ("peak RSS MiB", "peak_rss_bytes", ".0f"),
           ("peak PSS MiB", "peak_pss_bytes", ".0f"))


@dataclass(frozen=True)
class PointResult:
    """Both sides' figures at one point and seed, the order they ran in and the load average
    around it; the time to quality (TRL the reference) and each side's per-step ``(rewards, step
    seconds)`` for the reward-against-seconds plot."""

    point: GridPoint
    ours: SideFigures
    theirs: SideFigures
    order: tuple[str, ...]
    load: tuple[float, float]
    parameters: int
    quality: TimeToQuality | None = None
    curves: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...] = ()
    seed: int = 1


def _value(figures: SideFigures, field: str) -> float | None:
    v = getattr(figures, field)
    return None if v is None else (v / MIB if field.startswith("peak_") else v)


def ratios(result: PointResult) -> dict[str, float | None]:
    """``{figure label: replayrl / TRL}`` for every figure of :data:`FIGURES` (None if either
    side lacks it or TRL's is 0)."""
    return {label: ratio(_value(result.ours, f), _value(result.theirs, f)) for label, f, _ in FIGURES}


def _cell(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _cells(values: Sequence[float | None], spec: str) -> str:
    return " / ".join(_cell(v, spec) for v in values)


def grid_table(results: Sequence[PointResult]) -> str:
    """Markdown table: one row per point; per figure replayrl, TRL and the ratio."""
    head = ["model", "answer tokens (mean r / T)"]
    for label, _, _ in FIGURES:
        head += [f"{label} r", "T", "r/T"]
    head += ["reward r", "T", "load avg"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for res in results:
        p = res.point
        row = [f"{p.model_size} ({res.parameters / 1e6:.1f} M)",
               f"{p.answer_tokens} ({res.ours.mean_answer_tokens:.1f} / {res.theirs.mean_answer_tokens:.1f})"]
        r = ratios(res)
        for label, field, spec in FIGURES:
            row += [_cell(_value(res.ours, field), spec), _cell(_value(res.theirs, field), spec),
                    _cell(r[label], ".2f")]
        row += [f"{res.ours.final_reward:.3f}", f"{res.theirs.final_reward:.3f}",
                f"{res.load[0]:.1f} -> {res.load[1]:.1f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def quality_table(results: Sequence[PointResult]) -> str:
    """Markdown table of the time to quality per point (:mod:`replayrl.tools.bench.time_to_quality`):
    the threshold, each side's seconds to it and their ratio, and the reward both hold after
    the same seconds."""
    lines = [f"| model | answer tokens | seed | threshold ({QUALITY_SHARE} x TRL's final) | seconds r "
             "| T | r/T | equal seconds | reward r | T |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        q, p = res.quality, res.point
        if q is None:
            continue
        lines.append(f"| {p.model_size} | {p.answer_tokens} | {res.seed} | {q.threshold:.3f} | "
                     f"{_cell(q.seconds_ours, '.1f')} | {_cell(q.seconds_theirs, '.1f')} | "
                     f"{_cell(q.seconds_ratio, '.2f')} | {q.equal_seconds:.1f} | "
                     f"{_cell(q.reward_ours, '.3f')} | {_cell(q.reward_theirs, '.3f')} |")
    return "\n".join(lines)


def seeds_table(results: Sequence[PointResult]) -> str:
    """Markdown table of the time to quality over seeds, one row per point: each side's seconds
    to its seed's threshold and their ratio, seed by seed (``n/a``: not reached), and the ratio
    of the two sides' mean seconds (``n/a`` unless every seed reached it on both sides)."""
    points = list(dict.fromkeys(r.point for r in results))
    lines = ["| model | answer tokens | seeds | seconds r | T | r/T per seed | of the means |",
             "|---|---:|---|---|---|---|---:|"]
    for point in points:
        runs = [r for r in results if r.point == point and r.quality is not None]
        ours = [r.quality.seconds_ours for r in runs]
        theirs = [r.quality.seconds_theirs for r in runs]

        means = (None if not runs or None in ours or None in theirs
                 else ratio(sum(ours) / len(ours), sum(theirs) / len(theirs)))
        lines.append(f"| {point.model_size} | {point.answer_tokens} | "
                     f"{' / '.join(str(r.seed) for r in runs)} | {_cells(ours, '.1f')} | "
                     f"{_cells(theirs, '.1f')} | {_cells([r.quality.seconds_ratio for r in runs], '.2f')} | "
                     f"{_cell(means, '.2f')} |")
    return "\n".join(lines)


def plot_ratios(results: Sequence[PointResult], path: Path) -> Path:
    """PNG of the ratios replayrl / TRL over the grid: one panel per figure, answer tokens on
    the x axis (log), one line per model size; dashed 2x on the generated-tokens panel and 1x on
    the memory panels. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4 * len(FIGURES), 3.6))
    sizes = list(dict.fromkeys(r.point.model_size for r in results))
    for ax, (label, field, _) in zip(axes, FIGURES):
        for size in sizes:
            pts = [(r.point.answer_tokens, ratios(r)[label]) for r in results if r.point.model_size == size]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=size)
        target = 2.0 if field == "generated_tokens_per_second" else 1.0
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("answer tokens (max new)")
        ax.set_title(f"{label}: replayrl / TRL", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].legend(title="model")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- running the points


def replayrl_worker(spec_path: str, result_path: str) -> None:
    """Child process: one replayrl run (:func:`run_replayrl`) of the spec's settings; writes
    the :class:`SideRun` as JSON to ``result_path``."""
    spec = json.loads(Path(spec_path).read_text())
    config = run_config(spec["steps"], spec["seed"], spec["output_dir"], spec["overrides"])
    Path(result_path).write_text(strict_json.dumps(asdict(run_replayrl(config))))


def run_replayrl_child(steps: int, seed: int, output_dir: Path, overrides: dict, work: Path) -> SideRun:
    """replayrl in its own process (:func:`replayrl_worker`), its tree's memory sampled.

    Raises:
        PeerBenchError: the child failed (its stderr's tail in the message).
    """
    spec_path, result_path = work / "replayrl_spec.json", work / "replayrl_result.json"
    spec_path.write_text(strict_json.dumps({"steps": steps, "seed": seed, "output_dir": str(output_dir),
                                            "overrides": overrides}))
    proc, memory = run_sampled([sys.executable, "-m", "replayrl.tools.bench.peer_grid",
                                "--replayrl-worker", str(spec_path), str(result_path)], os.environ)
    if proc.returncode != 0:
        raise PeerBenchError(f"replayrl side failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(result_path.read_text())
    out.update(peak_rss_bytes=memory.peak_rss_bytes, peak_pss_bytes=memory.peak_pss_bytes)
    return SideRun(**{k: tuple(v) if isinstance(v, list) else v for k, v in out.items()})


def run_point(point: GridPoint, steps: int, seed: int, window: int, work: Path, trl_first: bool,
              overrides: dict, replayrl_steps: int | None = None) -> tuple[PointResult, object]:
    """Both sides at ``point`` in the given order (TRL ``steps`` steps, replayrl
    ``replayrl_steps``, default ``steps``); returns the result and the replayrl config.

    Raises:
        PeerBenchError: a side failed, or replayrl's checkpoint-init differs from TRL's.
    """
    from replayrl.tools.run.launcher import write_initial_checkpoint

    values = same_function(steps, seed, {**overrides, **point.overrides()})
    ours_steps = replayrl_steps or steps
    config = run_config(ours_steps, seed, str(work / "replayrl"), values)
    trl_config = run_config(steps, seed, str(work / "replayrl"), values)
    checkpoint = write_initial_checkpoint(config, work / "checkpoint-init")
    before = os.getloadavg()[0]
    runs = {}
    for side in (("TRL", "replayrl") if trl_first else ("replayrl", "TRL")):
        runs[side] = (run_trl(trl_config, checkpoint, work) if side == "TRL"
                      else run_replayrl_child(ours_steps, seed, work / "replayrl", values, work))
    ours = work / "replayrl" / "checkpoint-init" / "model.safetensors"
    if _sha256(ours) != _sha256(checkpoint / "model.safetensors"):
        raise PeerBenchError(f"{point}: replayrl's checkpoint-init differs from the one TRL loaded")
    from safetensors.torch import load_file

    parameters = sum(t.numel() for name, t in load_file(str(ours)).items() if ".indexer." not in name)
    ours_run, theirs_run = runs["replayrl"], runs["TRL"]
    quality = time_to_quality(ours_run.rewards, ours_run.step_seconds, theirs_run.rewards,
                              theirs_run.step_seconds, window)
    return PointResult(point, side_figures(ours_run, window), side_figures(theirs_run, window),
                       tuple(runs), (before, os.getloadavg()[0]), parameters, quality,
                       ((ours_run.rewards, ours_run.step_seconds),
                        (theirs_run.rewards, theirs_run.step_seconds)), seed), config


def grid_report(results: Sequence[PointResult], configs: Sequence, steps: int, window: int,
                plot: Path, replayrl_steps: int | None = None) -> str:
    """The printed report: what varies per point, the settings of both sides (of the first
    point; only model size, new tokens and task change), the time to quality per seed and (more
    than one seed) over seeds, the rates table of the first seed and where the plots are.
    ``results`` / ``configs``: one per point and seed, in the order they ran."""
    per_side = (f"{steps} steps per side" if replayrl_steps in (None, steps)
                else f"{replayrl_steps} replayrl / {steps} TRL steps")
    seeds = list(dict.fromkeys(r.seed for r in results))
    first = [r for r in results if r.seed == seeds[0]]
    lines = [f"bench peer --grid: replayrl vs TRL GRPOTrainer, {per_side} and point, "
             f"seed{'s' if len(seeds) > 1 else ''} {' '.join(map(str, seeds))}", ""]
    for res, config in zip(results, configs):
        if res.seed != seeds[0]:
            continue
        p = res.point
        threads = config.trainer.backward_switch_threads
        backward = (f"; replayrl's trainer backward on {threads} threads (--trainer-backward-threads)"
                    if threads else "")
        lines.append(f"- {p.model_size} x {p.answer_tokens}: {res.parameters:,} parameters without "
                     f"the indexer; ran {' then '.join(res.order)}; {function_compared(config)}{backward}")
    lines += ["", f"Time to quality: summed step seconds until the trailing {window}-step mean "
                  f"reward reaches {QUALITY_SHARE} x TRL's mean over its last {window} steps "
                  "(n/a: not within the run); reward r / T: each side's trailing mean after the "
                  "shorter side's total seconds.", "", quality_table(results), "",
              *([f"Over seeds {' / '.join(map(str, seeds))}:", "", seeds_table(results), ""]
                if len(seeds) > 1 else []),
              "Settings (first point; per point only the model size, the new tokens, past 2 "
                  "tokens the task (--task sort --answer-tokens N-1) and the backward threads "
                  "listed above change):", "",
              settings_table(configs[0]), "",
              "Rates: median over steps after each side's first 10 % (tools/bench/peer.py "
              "warmup_steps). trainer tokens/s: "
              "(prompt + completion tokens of the step's samples) / trainer seconds (replayrl "
              "train_seconds; TRL step seconds minus seconds in model.generate). Memory: peak of "
              "the summed RSS / PSS of each side's process tree, sampled every 0.25 s from /proc "
              "(RSS counts shared pages once per process). reward: mean of the last "
              f"{min(window, steps)} steps. load avg: 1-minute load average before and after the "
              "point. r = replayrl, T = TRL" + (f"; seed {seeds[0]}" if len(seeds) > 1 else "") + ".",
              "", grid_table(first), "",
              f"plots: {plot} (ratios), {plot.with_name('peer_grid_reward.png')} (reward against "
              "seconds)"]
    return "\n".join(lines)


def size_settings(point: GridPoint, overrides: dict | None, size_overrides: dict | None) -> dict:
    """The replayrl settings (flag name -> value) a point adds to its own
    (:meth:`GridPoint.overrides`): ``overrides`` of every point, then its model size's
    ``size_overrides``."""
    return {**(overrides or {}), **(size_overrides or {}).get(point.model_size, {})}


def check_points(points: Sequence[GridPoint], overrides: dict, size_overrides: dict) -> None:
    """Refuse, before any point runs, per-size settings for a size the grid does not hold (they
    would do nothing) and any point whose replayrl settings make no valid run.

    Raises:
        BenchError: naming the size, or the point and the run's refusal.
    """
    unused = sorted(set(size_overrides) - {p.model_size for p in points})
    if unused:
        raise BenchError(f"--trainer-backward-threads names {', '.join(unused)}, which the grid "
                         f"does not hold")
    for point in points:
        try:
            run_config(2, 1, "unused", {**size_settings(point, overrides, size_overrides),
                                        **point.overrides()})
        except ConfigError as exc:
            raise BenchError(f"{point.model_size} x {point.answer_tokens}: {exc}") from None


def run_grid(points: Sequence[GridPoint], steps: int, seeds: Sequence[int], window: int,
             output_dir: Path, overrides: dict | None = None, size_overrides: dict | None = None,
             replayrl_steps: int | None = None) -> str:
    """Run every point at every seed (point by point; which side goes first alternates from
    point to point and from seed to seed), write the plots (the first seed's), return the report.

    ``overrides``: replayrl settings (flag name -> value) of every point; ``size_overrides``:
    ``{model size: settings}`` added at that size's points; ``replayrl_steps``: replayrl's
    steps per point when not ``steps`` (:func:`run_point`)."""
    results, configs = [], []
    with tempfile.TemporaryDirectory(prefix="rrl-peer-grid-") as tmp:
        for i, point in enumerate(points):
            for j, seed in enumerate(seeds):
                work = Path(tmp) / f"{point.model_size}-{point.answer_tokens}-seed{seed}"
                work.mkdir()
                # who goes first alternates from point to point (each seed's rates table) and
                # from seed to seed within a point
                res, config = run_point(point, steps, seed, window, work, bool((i + j) % 2),
                                        size_settings(point, overrides, size_overrides),
                                        replayrl_steps)
                results.append(res)
                configs.append(config)
                # the row as soon as it is measured: a grid stopped early keeps its points
                print(f"[grid] {point.model_size} x {point.answer_tokens}, seed {seed} done:\n"
                      f"{quality_table([res]).splitlines()[-1]}\n"
                      f"{grid_table([res]).splitlines()[-1]}", file=sys.stderr, flush=True)
    first = [r for r in results if r.seed == seeds[0]]
    plot = plot_ratios(first, Path(output_dir) / "peer_grid.png")
    plot_reward_curves([(f"{r.point.model_size} x {r.point.answer_tokens}",
                         {"replayrl": r.curves[0], "TRL": r.curves[1]}, r.quality.threshold)
                        for r in first if r.quality is not None],
                       plot.with_name("peer_grid_reward.png"), window)
    return grid_report(results, configs, steps, window, plot, replayrl_steps)


def _grid(args, overrides: dict, parser) -> str:
    """``--grid`` of :func:`replayrl.tools.bench.peer.main`: parse it, run it, return the report."""
    try:
        points = parse_grid(args.grid)
    except BenchError as exc:
        parser.error(str(exc))
    try:
        check_points(points, overrides, args.size_overrides)
    except BenchError as exc:
        parser.error(str(exc))
    return run_grid(points, args.steps, args.seeds, args.window, Path(args.output_dir), overrides,
                    args.size_overrides, args.replayrl_steps)


def main(argv: list[str] | None = None) -> int:
    """``replayrl bench peer``: :func:`replayrl.tools.bench.peer.main` with ``--grid``
    (``--replayrl-worker SPEC RESULT`` is the replayrl child of a grid point)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--replayrl-worker"]:
        replayrl_worker(argv[1], argv[2])
        return 0
    return peer_main(argv, grid=_grid)


if __name__ == "__main__":
    raise SystemExit(main())
