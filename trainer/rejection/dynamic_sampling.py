"""Dynamic sampling (DAPO, arXiv:2503.14476): which prompt groups carry a learning signal.

A prompt group whose ``n`` rewards are all equal has GRPO advantages ``r_i - mean = 0`` for
every sample: it adds no gradient, only tokens to the loss denominator. With
``--dynamic-sampling`` such a group is dropped whole and refilled through exact refill
(docs/design/rejection-sampling.md#exact-refill), exactly like a group the RS gate rejected, so every optimizer
step trains on ``rollout_batch_size`` informative groups or fails before the optimizer step.

Pure: no actors, no I/O. :class:`replayrl.trainer.rejection.refill.RefillCoordinator` combines
:func:`informative_groups` with the RS gate's group admission (:func:`combine_admission`).
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence

from replayrl.trainer.errors import RefillConfigError

__all__ = ["informative_groups", "combine_admission"]


def informative_groups(rewards: Sequence[float], group_ids: Sequence[Hashable], *,
                       n_samples_per_prompt: int) -> dict[Hashable, bool]:
    """Whether each prompt group's rewards differ (``max != min``, exact float comparison).

    Exact comparison is DAPO's ``0 < #correct < G`` for 0/1 rewards and, for graded rewards,
    means "some advantage is non-zero": two rewards differing in the last bit already give
    non-zero GRPO advantages.

    Args:
        rewards: per-sample scalar reward [B] (floats, finite).
        group_ids: per-sample prompt-group id [B] (any hashable); a group's samples need not be
            contiguous.
        n_samples_per_prompt: ``n``; every group must hold exactly ``n`` samples, ``n >= 2``
            (one sample has no variance to measure).

    Returns:
        ``{group_id: informative}`` in order of first appearance.

    Raises:
        RefillConfigError: length mismatch, ``n < 2``, a non-finite reward (naming the sample
            and its group) or a group of the wrong size (naming it).
    """
    if isinstance(n_samples_per_prompt, bool) or not isinstance(n_samples_per_prompt, int) \
            or n_samples_per_prompt < 2:
        raise RefillConfigError(f"dynamic sampling needs n_samples_per_prompt >= 2, got "
                                f"{n_samples_per_prompt!r}")
    rewards, ids = list(rewards), list(group_ids)
    if len(rewards) != len(ids):
        raise RefillConfigError(f"{len(rewards)} rewards for {len(ids)} group ids")
    seen: dict[Hashable, list[float]] = {}
    for i, (r, gid) in enumerate(zip(rewards, ids)):
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise RefillConfigError(f"sample {i} (group {gid!r}): reward must be a finite "
                                    f"number, got {r!r}")
        seen.setdefault(gid, []).append(float(r))
    wrong = {g: len(v) for g, v in seen.items() if len(v) != n_samples_per_prompt}
    if wrong:
        raise RefillConfigError(f"prompt groups with a sample count other than "
                                f"n_samples_per_prompt={n_samples_per_prompt}: {wrong}")
    return {g: max(v) != min(v) for g, v in seen.items()}


def combine_admission(gate: Mapping[Hashable, bool],
                      informative: Mapping[Hashable, bool]) -> dict[Hashable, bool]:
    """A group is admitted iff the RS gate admits it AND its rewards differ.

    Args:
        gate: ``{group_id: admitted}`` from the RS gate's group admission.
        informative: ``{group_id: informative}`` from :func:`informative_groups`, same groups.

    Returns:
        ``{group_id: admitted}`` in ``gate``'s order.

    Raises:
        RefillConfigError: the two mappings hold different groups.
    """
    if set(gate) != set(informative):
        raise RefillConfigError(f"RS admission and dynamic sampling disagree on the groups: "
                                f"{sorted(map(repr, set(gate) ^ set(informative)))[:8]}")
    return {g: ok and informative[g] for g, ok in gate.items()}
