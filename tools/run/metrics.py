"""Per-step metrics: one JSONL line each, a live progress display, the reward plot, the summary."""
from __future__ import annotations

import logging
import math
import os
import traceback
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from replayrl.tools.errors import MetricsHookError
from replayrl.transport import strict_json

log = logging.getLogger("replayrl")


def edge_means(values: Sequence[float], fraction: float = 0.1) -> tuple[float, float]:
    """Mean of the first and of the last ``ceil(fraction * len)`` values (at least one each).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("no values")
    k = max(1, math.ceil(fraction * len(values)))
    return sum(values[:k]) / k, sum(values[-k:]) / k


ENTROPY_FLOOR = 0.05
"""Support entropy (nats, mean of the last :data:`COLLAPSE_WINDOW` steps) below which a run whose
reward is still below its best is reported as collapsed (docs/design/trainer-math.md#entropy-collapse)."""
COLLAPSE_WINDOW = 20
"""Steps over which :class:`CollapseWatch` averages the reward and the entropy."""
COLLAPSE_MARGIN = 0.1
"""How far below its best the reward must be for :class:`CollapseWatch` to speak: a converged
run (reward within this of the best a sample scored) is deterministic on purpose."""


class CollapseWatch:
    """Notices entropy collapse: the policy turned (nearly) deterministic while its reward is
    still below its best, so it samples too few alternatives to learn more.

    Fed one step's metrics at a time (:meth:`see`); says so once, on the first step where the
    mean support entropy of the last ``window`` steps is below ``floor`` nats while the mean
    reward of those steps is below the best reward one sample scored so far (``reward_max``;
    the best step mean when the rows lack it) by more than ``margin``.
    """

    def __init__(self, floor: float = ENTROPY_FLOOR, window: int = COLLAPSE_WINDOW,
                 margin: float = COLLAPSE_MARGIN) -> None:
        self.floor, self.window, self.margin = floor, window, margin
        self._rewards: list[float] = []
        self._entropies: list[float] = []
        self._best = -math.inf
        self.warned = False

    def see(self, metrics: Mapping) -> str | None:
        """The one-line warning on the step that first shows collapse, else ``None``
        (also after it was said once, and for a row without reward or entropy)."""
        reward, entropy = metrics.get("reward_mean"), metrics.get("support_entropy_mean")
        if reward is None or entropy is None or self.warned:
            return None
        self._best = max(self._best, metrics.get("reward_max") or reward)
        self._rewards = (self._rewards + [reward])[-self.window:]
        self._entropies = (self._entropies + [entropy])[-self.window:]
        if len(self._rewards) < self.window:
            return None
        mean_r = sum(self._rewards) / self.window
        mean_h = sum(self._entropies) / self.window
        if mean_h < self.floor and mean_r < self._best - self.margin:
            self.warned = True
            return (f"replayrl: entropy collapse at step {metrics.get('step')}: support entropy "
                    f"{mean_h:.3f} < {self.floor} nats while the reward {mean_r:.3f} is below its "
                    f"best {self._best:.3f}; the policy no longer explores (see "
                    f"docs/design/trainer-math.md#entropy-collapse: --entropy-coef, --lr)")
        return None


def shown(metrics: Mapping, key: str, spec: str) -> str:
    """``metrics[key]`` formatted with ``spec``, or ``n/a`` when the step has no value for it
    (the key is absent, e.g. no flip rate without a replayed trace, or ``None``, a value
    that was not finite). A missing value is never shown as 0."""
    value = metrics.get(key)
    return "n/a" if value is None else format(value, spec)


def frozen(value: Any) -> Any:
    """A read-only view of JSON-like data: dicts become mappingproxies, lists tuples."""
    if isinstance(value, dict):
        return MappingProxyType({k: frozen(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    return value


def progress_status(metrics: Mapping) -> str:
    """The progress display's text for one row. A figure the row lacks is ``n/a``, never 0 and
    never an error: a skipped step has no update figures, a flip rate without that replay's
    trace is not 0 flips, a value that was not finite is ``None``."""
    parts = [f"skipped ({metrics.get('skip_reason', '?')})"] if metrics.get("skipped") else []
    parts += [f"reward {shown(metrics, 'reward_mean', '.3f')}",
              f"|Δlogp| {shown(metrics, 'train_rollout_logprob_abs_diff', '.4f')}",
              f"stale {shown(metrics, 'staleness_mean', '.1f')}",
              f"flips {shown(metrics, 'routing_flip_rate', '.0f')}"
              f"/{shown(metrics, 'indexer_flip_rate', '.0f')}"]
    if "refill_rounds" in metrics and "admitted_groups" in metrics:
        parts.append(f"groups {metrics['admitted_groups']} in {metrics['refill_rounds']} refill rounds")
    parts.append(f"{shown(metrics, 'step_seconds', '.2f')}s/step")
    return "  ".join(parts)


def open_tensorboard(directory: Path) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` writing event files to ``directory``.

    Raises:
        ImportError: the ``tensorboard`` package is missing (names the extra to install).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError("--use-tensorboard needs the tensorboard package: "
                          "pip install 'replayrl[tensorboard]'") from exc
    return SummaryWriter(log_dir=str(directory))


def open_wandb(directory: Path, config: Any) -> Any:
    """A Weights & Biases run (``wandb.init``) whose files go under ``directory/wandb``, with
    the run config (``config.to_json()``, strict JSON: an unbounded ``--rs-upper`` is null).

    The project is ``$WANDB_PROJECT`` or ``replayrl``, the run name the output directory's
    name. Online or offline is wandb's own choice: ``WANDB_MODE=offline`` writes the whole run
    to ``directory/wandb/offline-run-*`` without any network (``wandb sync`` uploads it later).
    wandb's console capture is off (the progress display owns the terminal).

    Raises:
        ImportError: the ``wandb`` package is missing (names the extra to install).
    """
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("--use-wandb needs the wandb package: "
                          "pip install 'replayrl[wandb]'") from exc
    directory.mkdir(parents=True, exist_ok=True)
    run_config = strict_json.loads(config.to_json()) if config is not None else {}
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "replayrl"), dir=str(directory),
                      name=directory.resolve().name, config=run_config,
                      settings=wandb.Settings(console="off"))


def scalars(metrics: Mapping) -> dict[str, int | float]:
    """The numeric values of a row (bools excluded), as TensorBoard and W&B log them: every
    figure of ``metrics.jsonl`` but the text (``skip_reason``), the lists (``prompt_indices``,
    ``refill_round_detail``) and the values that were not finite (``None``)."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def earlier_rows(path: Path) -> list[dict]:
    """The rows of an earlier run's ``metrics.jsonl``. A last line that is not complete JSON
    (the run was killed while writing it: each row is one write, flushed, so only the last can
    be cut short) is left out.

    Raises:
        OSError: ``path`` cannot be read.
        ValueError: a line before the last is not JSON (the file is not a replayrl metrics
            file; names the file and the line).
    """
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(strict_json.loads(line))
        except ValueError as exc:
            if number == len(lines):
                log.warning("replayrl: %s: its last line is cut short (a run killed while "
                            "writing it); left out", path)
                break
            raise ValueError(f"{path}:{number}: not a metrics row: {exc}") from None
    return rows


EPISODE_KEYS = (("turns_mean", "turns"), ("tool_calls_mean", "tool calls"),
                ("parse_errors_mean", "parse errors"))
"""The per-episode means of a multi-turn row (``--rollout-max-turns > 1``) the summary line
shows, with their labels."""


def episode_summary(rows: Sequence[Mapping]) -> str:
    """The summary line's part for a multi-turn run (rows with ``turns_mean``), ``""`` for
    others: the last 10 % of steps' means of turns, tool calls and unreadable tool calls per
    trajectory (those the rows have), the environment failures of the whole run (``--env``)
    and the final-answer accuracy of the first and last 10 % of steps; two spaces after it."""
    if not any(r.get("turns_mean") is not None for r in rows):
        return ""
    parts = []
    for key, label in EPISODE_KEYS:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            parts.append(f"{label} last10%={edge_means(values)[1]:.2f}")
    if any("env_failures" in r for r in rows):
        parts.append(f"env failures={sum(r.get('env_failures') or 0 for r in rows)}")
    accuracy = [r["final_answer_accuracy"] for r in rows if r.get("final_answer_accuracy") is not None]
    if accuracy:
        first, last = edge_means(accuracy)
        parts.append(f"accuracy first10%={first:.3f} last10%={last:.3f}")
    return "  ".join(parts) + "  "


def _seconds(value: float) -> str:
    """Seconds for the summary line: one decimal below 10 s (``0.4 s``), whole above (``33 s``)."""
    return f"{value:.1f} s" if round(value, 1) < 10 else f"{value:.0f} s"


class MetricsRecorder:
    """Writes ``metrics.jsonl`` under ``output_dir`` and drives a rich progress bar.

    Use as a context manager; :meth:`record` is the ``on_step`` callback of the train loop.
    With ``tensorboard`` (``--use-tensorboard``) every numeric value of a row is also written as
    a TensorBoard scalar at its step, under ``output_dir/tensorboard``; with ``wandb``
    (``--use-wandb``) it is logged to a W&B run under ``output_dir/wandb`` at its step, with the
    run config (:func:`open_wandb`).
    ``hooks`` (``--metrics-hook``) are called after each step as ``hook(config, metrics)`` with
    the frozen run config and a read-only view of the step's metrics: a logger can neither change
    the run nor what later loggers see, and nothing is copied defensively.
    With ``resume_step`` (a run resumed with ``--load`` from a checkpoint taken after
    ``resume_step`` steps) the rows of an earlier ``metrics.jsonl`` in ``output_dir`` for the
    steps before it are kept, and count in :meth:`summary` and :meth:`plot`; its rows of later
    steps, which the resumed run trains again, are dropped, and so is a last line cut short by
    a kill (:func:`earlier_rows`). Without it the file starts empty.
    """

    def __init__(self, output_dir: str | Path, num_steps: int, show_progress: bool = True,
                 hooks: Sequence[Callable[[Any, Mapping], None]] = (), config: Any = None,
                 tensorboard: bool = False, resume_step: int | None = None,
                 wandb: bool = False) -> None:
        self.hooks = tuple(hooks)
        self._tensorboard = open_tensorboard(Path(output_dir) / "tensorboard") if tensorboard else None
        self._wandb = open_wandb(Path(output_dir), config) if wandb else None
        self.config = config
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / "metrics.jsonl"
        self.rows: list[dict] = []
        if resume_step is not None and self.path.exists():
            self.rows = [r for r in earlier_rows(self.path)
                         if r.get("step", resume_step) < resume_step]
        self._file = self.path.open("w")
        for row in self.rows:
            self._file.write(strict_json.dumps(row) + "\n")
        self._file.flush()
        self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                  disable=not show_progress)
        self._task = self._progress.add_task("train", total=num_steps, status="starting actors")
        self.collapse = CollapseWatch()

    status = staticmethod(progress_status)
    """The progress display's text for one row (another command's recorder shows its own)."""

    def __enter__(self) -> "MetricsRecorder":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if exc and exc[0] is not None else 0)

    def record(self, metrics: dict) -> None:
        """Append one step's metrics (a flat dict of JSON-able values) as one strict-JSON line.

        Every row is written, whatever keys it has: a skipped step (``skipped: 1``, no update
        figures) is also logged as a warning on the ``replayrl`` logger, naming its
        ``skip_reason``.

        A value that is not finite (e.g. the mean of no values, NaN) is recorded as ``None``
        (``null`` in the file): the row kept, the line written and the hooks' view agree.

        Raises:
            replayrl.transport.strict_json.NonFiniteJSON / TypeError: a value JSON cannot hold.
            MetricsHookError: a hook raised (after the row was written).
        """
        metrics = strict_json.finite_or_none(metrics)
        line = strict_json.dumps(metrics)
        self.rows.append(metrics)
        self._file.write(line + "\n")
        self._file.flush()
        if metrics.get("skipped"):
            log.warning("replayrl: step %s skipped (%s): nothing trained, weights and version %s "
                        "unchanged", metrics.get("step"), metrics.get("skip_reason"),
                        metrics.get("trainer_version"))
        warning = self.collapse.see(metrics)
        if warning:
            log.warning("%s", warning)
        self._progress.update(self._task, advance=1, status=self.status(metrics))
        if self._tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, metrics.get("step", len(self.rows)))
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars(metrics), step=metrics.get("step", len(self.rows)))
        view = frozen(metrics)
        for hook in self.hooks:
            try:
                hook(self.config, view)
            except Exception as exc:
                name = f"{getattr(hook, '__module__', '?')}:{getattr(hook, '__qualname__', hook)}"
                raise MetricsHookError(
                    f"--metrics-hook {name} raised on step {metrics.get('step')}: "
                    f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}") from exc

    def plot(self) -> Path:
        """Save ``reward.png`` and return its path: the training reward mean per step with each
        evaluation set's mean reward and pass@k (``eval/NAME/...`` rows) and, on a second axis
        beside it when the rows carry it, the support entropy; below them the mean response
        length. A multi-turn run's rows add the final-answer accuracy beside the reward and,
        on a second axis below, the turns, tool calls and unreadable tool calls per trajectory
        (:data:`EPISODE_KEYS`)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, low) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
        ax.plot([r["step"] for r in self.rows], [r["reward_mean"] for r in self.rows], marker=".",
                label="train reward")
        accuracy = [(r["step"], r["final_answer_accuracy"]) for r in self.rows
                    if r.get("final_answer_accuracy") is not None]
        if accuracy:  # a multi-turn run: the share of trajectories whose final answer is right
            ax.plot(*zip(*accuracy), linestyle=":", label="final-answer accuracy")
        eval_keys = sorted({k for r in self.rows for k in r if k.startswith("eval/")
                            and ("reward_mean" in k or "pass@" in k)})
        for key in eval_keys:
            points = [(r["step"], r[key]) for r in self.rows if r.get(key) is not None]
            ax.plot(*zip(*points), marker="o", linestyle="--", label=key)
        ax.set_ylabel("mean reward / pass@k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        entropy = [(r["step"], r["support_entropy_mean"]) for r in self.rows
                   if r.get("support_entropy_mean") is not None]
        if entropy:  # beside the reward: a collapse shows as the entropy falling to 0
            right = ax.twinx()
            right.plot(*zip(*entropy), color="tab:red", alpha=0.6, label="support entropy (nats)")
            right.set_ylabel("support entropy (nats)")
            right.set_ylim(bottom=0)
            more = right.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        ax.legend(handles, labels, fontsize=7)
        ax.set_title("replayrl: reward and entropy")
        for key, label in (("response_len_mean", "response tokens"),):
            points = [(r["step"], r[key]) for r in self.rows if r.get(key) is not None]
            if points:
                low.plot(*zip(*points), marker=".", label=label)
        low.set_xlabel("optimizer step")
        low.grid(alpha=0.3)
        low.legend(fontsize=7)
        episode = [(key, label) for key, label in EPISODE_KEYS
                   if any(r.get(key) is not None for r in self.rows)]
        if episode:  # a multi-turn run: turns and tool calls per trajectory beside the length
            per = low.twinx()
            for (key, label), color in zip(episode, ("tab:green", "tab:purple", "tab:red")):
                points = [(r["step"], r[key]) for r in self.rows if r.get(key) is not None]
                per.plot(*zip(*points), color=color, alpha=0.7, label=f"{label} / trajectory")
            per.set_ylim(bottom=0)
            per.legend(fontsize=7, loc="upper right")
        path = self.output_dir / "reward.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def summary(self, wall_seconds: float | None = None) -> str:
        """One line: first / last 10 % reward means, their ratio, the support entropy of the
        last 10 % of steps (nats; ``n/a`` when the rows lack it), the traces' wire bytes per
        trajectory token averaged over the steps (``trace_bytes_per_token``; ``n/a`` when the
        rows lack it), steps (and how many were
        skipped, when any), the seconds of the steps and, given ``wall_seconds``, those of the
        whole run with its start-up (actor processes, initial checkpoint): a short run's steps
        take a fraction of the time a user waits."""
        first, last = edge_means([r["reward_mean"] for r in self.rows])
        ratio = f"{last / first:.1f}x" if first > 0 else "n/a (first10% is 0)"
        entropies = [r["support_entropy_mean"] for r in self.rows
                     if r.get("support_entropy_mean") is not None]
        entropy = f"{edge_means(entropies)[1]:.3f}" if entropies else "n/a"
        wire = [r["trace_bytes_per_token"] for r in self.rows if r.get("trace_bytes_per_token") is not None]
        trace_bytes = f"{sum(wire) / len(wire):.1f}" if wire else "n/a"
        seconds = sum(r["step_seconds"] for r in self.rows)
        skipped = sum(1 for r in self.rows if r.get("skipped"))
        steps = f"{len(self.rows)} steps" + (f" ({skipped} skipped)" if skipped else "")
        took = f"{_seconds(seconds)}" + (f" ({_seconds(wall_seconds)} with start-up)"
                                         if wall_seconds is not None else "")
        return (f"replayrl: {steps} in {took}  reward first10%={first:.3f} "
                f"last10%={last:.3f} ratio={ratio}  entropy last10%={entropy}  "
                f"trace B/token={trace_bytes}  "
                f"{episode_summary(self.rows)}metrics={self.path}")
