"""Per-episode figures of a multi-turn batch (``--rollout-max-turns > 1``), as
``metrics.jsonl`` records them beside ``tool_calls_mean`` and ``env_failures``."""
from __future__ import annotations

from typing import Sequence

from replayrl.rollout.episodes.turn_loop import Episode

__all__ = ["episode_metrics"]


def episode_metrics(episodes: Sequence[Episode], verified: Sequence[float | None], *,
                    env: bool) -> dict[str, float]:
    """The batch's per-episode means.

    Args:
        episodes: the batch's trajectories (``B >= 1``).
        verified: the verifier's reward of each (``None`` where no verifier scored it:
            ``--env-reward env``).
        env: an ``--env`` environment answered the tool calls (its parser's errors count).

    Returns:
        ``turns_mean`` (engine turns per trajectory), with ``env`` ``parse_errors_mean`` (tool
        calls per trajectory the environment's parser could not read) and, where every
        trajectory was verified, ``final_answer_accuracy``: the share whose verifier reward is
        1 (the final answer right; a format credit from ``--env-reward sum`` is not counted).

    Raises:
        ValueError: no episodes, or ``verified`` of another length.
    """
    if not episodes or len(verified) != len(episodes):
        raise ValueError(f"{len(episodes)} episodes with {len(verified)} verifier rewards")
    n = len(episodes)
    out = {"turns_mean": sum(len(e.turns) for e in episodes) / n}
    if env:
        out["parse_errors_mean"] = sum(e.parse_errors for e in episodes) / n
    if all(v is not None for v in verified):
        out["final_answer_accuracy"] = sum(1 for v in verified if v == 1.0) / n
    return out
