"""Time to quality: wall seconds until a side's policy is good, not its tokens per second.

A trainer is judged by how soon it reaches a good policy. For two runs on the same task and
budget (``replayrl bench peer``: replayrl and TRL's ``GRPOTrainer``) the threshold is a reward
the reference side is known to hold: :data:`QUALITY_SHARE` of the mean reward of its last
``window`` steps. The figures are then

* the summed step seconds until each side's trailing ``window``-step mean reward first reaches
  that threshold (:func:`seconds_to_threshold`), and their ratio;
* the reward each side holds after the same wall time (the shorter run's total seconds): the
  trailing ``window``-step mean over the steps each side had finished by then
  (:func:`reward_after`).

A threshold set by the reference's own end point is one a good policy reaches, not one the
lagging side happens to touch; a side that never gets there shows ``None`` (not reached).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

__all__ = ["QUALITY_SHARE", "TimeToQuality", "plot_reward_curves", "quality_threshold",
           "reward_after", "reward_curve", "seconds_to_threshold", "time_to_quality"]

QUALITY_SHARE = 0.9
"""The share of the reference side's final reward (mean of its last ``window`` steps) that
counts as the quality threshold."""


def _trailing_mean(rewards: Sequence[float], end: int, window: int) -> float:
    chunk = rewards[max(0, end - window):end]
    return sum(chunk) / len(chunk)


def seconds_to_threshold(rewards: Sequence[float], step_seconds: Sequence[float],
                         threshold: float, window: int = 10) -> float | None:
    """Summed step seconds up to and including the first step whose trailing ``window``-step
    mean reward is ``>= threshold``; ``None`` when no full window reaches it.

    Raises:
        ValueError: ``rewards`` and ``step_seconds`` differ in length, or ``window < 1``.
    """
    if len(rewards) != len(step_seconds):
        raise ValueError(f"{len(rewards)} rewards but {len(step_seconds)} step times")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window:end]) / window >= threshold:
            return float(sum(step_seconds[:end]))
    return None


def quality_threshold(reference_rewards: Sequence[float], window: int,
                      share: float = QUALITY_SHARE) -> float:
    """``share`` x the mean reward of the last ``window`` steps of the reference run (all of its
    steps when fewer).

    Raises:
        ValueError: no reward, ``window < 1`` or ``share`` outside ``(0, 1]``.
    """
    if not reference_rewards:
        raise ValueError("quality threshold of a run with no steps")
    if window < 1 or not 0.0 < share <= 1.0:
        raise ValueError(f"need window >= 1 and 0 < share <= 1, got {window}, {share}")
    return share * _trailing_mean(reference_rewards, len(reference_rewards), window)


def reward_curve(rewards: Sequence[float], step_seconds: Sequence[float],
                 window: int) -> tuple[list[float], list[float]]:
    """``(seconds, reward)``: after each step, the summed step seconds so far and the trailing
    ``window``-step mean reward (fewer steps at the start).

    Raises:
        ValueError: the two sequences differ in length, or ``window < 1``.
    """
    if len(rewards) != len(step_seconds):
        raise ValueError(f"{len(rewards)} rewards but {len(step_seconds)} step times")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    seconds, total = [], 0.0
    for s in step_seconds:
        total += s
        seconds.append(total)
    return seconds, [_trailing_mean(rewards, end, window) for end in range(1, len(rewards) + 1)]


def reward_after(rewards: Sequence[float], step_seconds: Sequence[float], seconds: float,
                 window: int) -> float | None:
    """The trailing ``window``-step mean reward over the steps finished within ``seconds`` of
    summed step time; ``None`` when not even the first step had finished.

    Raises:
        ValueError: as :func:`reward_curve`.
    """
    times, means = reward_curve(rewards, step_seconds, window)
    done = [m for t, m in zip(times, means) if t <= seconds + 1e-9]
    return done[-1] if done else None


@dataclass(frozen=True)
class TimeToQuality:
    """Time-to-quality figures of one comparison (seconds are summed step seconds).

    Fields:
        threshold: the reward both sides must hold (:func:`quality_threshold` of the reference).
        seconds_ours, seconds_theirs: seconds until the trailing window mean first reaches it;
            ``None``: never within the run.
        equal_seconds: the shorter run's total seconds, where both rewards are read.
        reward_ours, reward_theirs: trailing window mean reward after ``equal_seconds``.
    """

    threshold: float
    seconds_ours: float | None
    seconds_theirs: float | None
    equal_seconds: float
    reward_ours: float | None
    reward_theirs: float | None

    @property
    def seconds_ratio(self) -> float | None:
        """``seconds_ours / seconds_theirs`` (None when either did not reach the threshold)."""
        if self.seconds_ours is None or not self.seconds_theirs:
            return None
        return self.seconds_ours / self.seconds_theirs


def time_to_quality(ours_rewards: Sequence[float], ours_seconds: Sequence[float],
                    theirs_rewards: Sequence[float], theirs_seconds: Sequence[float],
                    window: int, share: float = QUALITY_SHARE) -> TimeToQuality:
    """:class:`TimeToQuality` of two runs, ``theirs`` the reference that sets the threshold.

    Raises:
        ValueError: a run with no steps, or rewards and seconds of different lengths.
    """
    threshold = quality_threshold(theirs_rewards, window, share)
    equal = min(sum(ours_seconds), sum(theirs_seconds))
    return TimeToQuality(
        threshold,
        seconds_to_threshold(ours_rewards, ours_seconds, threshold, window),
        seconds_to_threshold(theirs_rewards, theirs_seconds, threshold, window),
        equal, reward_after(ours_rewards, ours_seconds, equal, window),
        reward_after(theirs_rewards, theirs_seconds, equal, window))


def plot_reward_curves(curves: Sequence[tuple[str, dict[str, tuple[Sequence[float], Sequence[float]]],
                                              float]], path: Path, window: int = 10) -> Path:
    """PNG of reward against wall seconds: one panel per comparison ``(title, {side: (rewards,
    step_seconds)}, threshold)``, a line per side (the trailing ``window``-step mean of
    :func:`reward_curve`) and the threshold dashed. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.4), squeeze=False)
    for ax, (title, sides, threshold) in zip(axes[0], curves):
        for side, (rewards, seconds) in sides.items():
            ax.plot(*reward_curve(rewards, seconds, window), label=side)
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds (summed steps)")
        ax.set_ylabel(f"reward, trailing {window} steps")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
