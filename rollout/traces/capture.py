"""Capture normalisation for external engines (SGLang, vLLM): their traces in replayrl's form.

An external engine does not hand out ``sample_support`` rows; it returns, per sampled token,
the top-k candidate ids with their logprobs (SGLang ``return_logprob`` with
``top_logprobs_num``), and per-position routing from an offset of the prompt
(``routed_experts_start``-style requests) when a multi-turn client asks for only the new part
of a context. These helpers turn that raw capture into the contract of ``rollout/sample.py``,
and refuse what cannot be turned into it honestly (docs/design/sample-contract.md#sample-contract; house rule:
never clamp or silently drop):

* :func:`normalize_support_row` -- one ``sample_support`` row ``[1 + top_k]``;
* :func:`check_sampled_logprob` -- a behaviour logprob must be finite;
* :func:`check_route_offset` -- where a turn's per-position rows start inside its context.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from replayrl.rollout.errors import CaptureError

__all__ = [
    "normalize_support_row",
    "check_sampled_logprob",
    "check_route_offset",
]


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def normalize_support_row(
    candidate_ids: Sequence[int],
    candidate_logprobs: Sequence[float],
    sampled_id: int,
    top_k: int,
    *,
    sample_id: Any = "?",
    index: int | None = None,
) -> np.ndarray:
    """One ``sample_support`` row from an engine's top-k candidates of one sampled token.

    Args:
        candidate_ids: ``k' <= top_k`` candidate token ids as the engine listed them (usually
            by descending logprob).
        candidate_logprobs: ``k'`` logprobs of those candidates under the engine's processed
            distribution; ``-inf`` marks a candidate that top-p / min-p removed.
        sampled_id: the token the engine sampled.
        top_k: support width ``W`` (``sample_support`` has ``1 + W`` columns), ``>= 1``.
        sample_id, index: named in error messages (trajectory and response position).

    Returns:
        int32 ``[1 + top_k]`` read-only: column 0 ``sampled_id``, columns ``1..`` the candidate
        ids in the engine's order with ``-inf`` candidates as ``-1``, padded with ``-1`` to
        ``top_k`` columns.

        Repair: with ties at the k-th logit an engine may list ``k`` tied candidates that do not
        include the one it sampled (its top-k kept another tie member than the list shows).
        The sampled id then overwrites the *weakest* valid candidate (lowest logprob; among
        equal logprobs the later column), so the width stays ``top_k`` and the sampled id is
        present exactly once. Case ``capture_repair_sampled_not_in_topk``: candidates
        ``[0, 1]`` with logprobs from logits ``[3, 1, 1, 1]``, sampled 3 -> ``[3, 0, 3]``.

    Raises:
        CaptureError (field ``sample_support``): ``top_k < 1``; lengths of ids and logprobs
        differ; more than ``top_k`` candidates; a NaN or ``+inf`` logprob; a negative id on a
        valid candidate; a repeated valid candidate; the sampled id listed with logprob
        ``-inf`` (a sampled token cannot have zero probability); no valid candidate at all.
    """
    where = f" at response index {index}" if index is not None else ""

    def fail(problem: str) -> CaptureError:
        return CaptureError(sample_id, "sample_support", problem + where)

    if not _is_int(top_k) or top_k < 1:
        raise fail(f"top_k must be an int >= 1, got {top_k!r}")
    if not _is_int(sampled_id) or sampled_id < 0:
        raise fail(f"sampled id must be an int >= 0, got {sampled_id!r}")
    ids = np.asarray(candidate_ids)
    logprobs = np.asarray(candidate_logprobs, dtype=np.float64)
    if ids.ndim != 1 or logprobs.ndim != 1 or len(ids) != len(logprobs):
        raise fail(f"candidate ids {ids.shape} and logprobs {logprobs.shape} must be 1-d of equal length")
    if len(ids) and ids.dtype.kind not in "iu":
        raise fail(f"candidate ids must be integers, got dtype {ids.dtype}")
    if len(ids) > top_k:
        raise fail(f"{len(ids)} candidates for top_k={top_k}; refusing to drop any")
    if np.isnan(logprobs).any() or np.isposinf(logprobs).any():
        raise fail(f"candidate logprobs must be finite or -inf, got {logprobs.tolist()}")
    valid = np.isfinite(logprobs)
    ids = ids.astype(np.int64)
    if (ids[valid] < 0).any():
        raise fail(f"negative candidate id among valid candidates {ids[valid].tolist()}")
    if len(np.unique(ids[valid])) != int(valid.sum()):
        raise fail(f"repeated candidate id among {ids[valid].tolist()}")
    if not valid.any():
        raise fail("no valid candidate (all logprobs -inf); the sampled token has no support")
    sampled = int(sampled_id)
    if (ids[~valid] == sampled).any():
        raise fail(f"sampled id {sampled} is listed with logprob -inf")
    row = np.full(1 + top_k, -1, dtype=np.int64)
    row[0] = sampled
    row[1:1 + len(ids)] = np.where(valid, ids, -1)
    if not (ids[valid] == sampled).any():
        valid_cols = np.flatnonzero(valid)
        lowest = logprobs[valid_cols].min()
        weakest = valid_cols[logprobs[valid_cols] == lowest][-1]
        row[1 + weakest] = sampled
    out = row.astype(np.int32)
    out.flags.writeable = False
    return out


def check_sampled_logprob(value: float, sample_id: Any, index: int) -> float:
    """Return a sampled token's behaviour logprob as a float, after checking it is finite.

    Args:
        value: the engine's logprob of the sampled token (nats, processed distribution).
        sample_id, index: the trajectory and the response position, named in the error.

    Raises:
        CaptureError (field ``rollout_logprobs``): NaN or infinite. Never clamped: a ``-inf``
        replaced by a large negative number would turn into an enormous importance weight.
    """
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise CaptureError(sample_id, "rollout_logprobs",
                           f"not a number at response index {index}: {value!r}") from None
    if not math.isfinite(v):
        raise CaptureError(sample_id, "rollout_logprobs",
                           f"non-finite sampled logprob {v} at response index {index}")
    return v


def check_route_offset(start: int, prompt_len: int, *, sample_id: Any = "?") -> int:
    """Check where an engine's per-position rows start inside a turn's context.

    A multi-turn client asks the engine for routing / indexer rows from position ``start`` of
    the context it sends (``prompt_len`` tokens); rows before ``start`` were captured by earlier
    turns. The engine forwards every context position, so ``start`` must name one of them:
    ``0 <= start < prompt_len`` (``prompt_len - 1`` = only the last context token, which the
    previous turn sampled but never forwarded). Case ``route_offset_bounds``: ``prompt_len``
    14 accepts 0 and 13, rejects -1, 14 and 15.

    Returns:
        ``start`` as an int.

    Raises:
        CaptureError (field ``route_start``): ``start`` or ``prompt_len`` not an int, or out of
        range.
    """
    if not _is_int(start) or not _is_int(prompt_len):
        raise CaptureError(sample_id, "route_start",
                           f"start {start!r} and prompt_len {prompt_len!r} must be ints")
    if not 0 <= int(start) < int(prompt_len):
        raise CaptureError(sample_id, "route_start",
                           f"start {int(start)} outside [0, prompt_len={int(prompt_len)})")
    return int(start)
