"""``replayrl sft``'s metrics: ``metrics.jsonl`` and the progress display as ``replayrl train``
writes them (:class:`replayrl.tools.run.metrics.MetricsRecorder`), with SFT's own progress
text, plot (``loss.png``) and summary line."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from replayrl.tools.run.metrics import MetricsRecorder, _seconds, edge_means, shown


def sft_status(metrics: Mapping) -> str:
    """The progress display's text for one SFT row (``n/a`` for a figure the row lacks)."""
    return (f"loss {shown(metrics, 'loss', '.4f')}  sure tokens "
            f"{shown(metrics, 'sure_token_share', '.2f')}  "
            f"{shown(metrics, 'step_seconds', '.2f')}s/step")


class SFTRecorder(MetricsRecorder):
    """:class:`MetricsRecorder` with SFT's progress text, plot and summary."""

    status = staticmethod(sft_status)

    def __init__(self, *args, **kwargs) -> None:
        """As :class:`MetricsRecorder`'s; the display starts without actors to wait for."""
        super().__init__(*args, **kwargs)
        self._progress.update(self._task, status="first step")

    def plot(self) -> Path:
        """Save ``loss.png`` (the step's mean token cross-entropy, nats, per step; below it the
        share of assistant tokens the policy gives probability above 1/2) and return its path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, low) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
        steps = [r["step"] for r in self.rows]
        ax.plot(steps, [r["loss"] for r in self.rows], marker=".")
        ax.set_ylabel("loss (nats / assistant token)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_title("replayrl sft: assistant-token cross-entropy")
        low.plot(steps, [r["sure_token_share"] for r in self.rows], marker=".")
        low.set_ylabel("tokens with p > 1/2")
        low.set_ylim(0, 1.02)
        low.set_xlabel("optimizer step")
        low.grid(alpha=0.3)
        path = self.output_dir / "loss.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def summary(self, wall_seconds: float | None = None) -> str:
        """One line: the steps and their seconds (and the whole command's), the loss of the
        first and last 10 % of steps, the rows skipped, the metrics file."""
        first, last = edge_means([r["loss"] for r in self.rows])
        seconds = sum(r["step_seconds"] for r in self.rows)
        took = _seconds(seconds) + (f" ({_seconds(wall_seconds)} with start-up)"
                                    if wall_seconds is not None else "")
        skipped = self.rows[-1].get("bad_rows_skipped", 0)
        return (f"replayrl sft: {len(self.rows)} steps in {took}  loss first10%={first:.4f} "
                f"last10%={last:.4f}  bad rows skipped={skipped}  metrics={self.path}")
