"""A batch of single-turn episodes assembled as columns, checked once for the whole batch.

:func:`replayrl.rollout.traces.trajectory.merge_turns` assembles and checks one trajectory at a
time, about a hundred microseconds each; for a batch of single-turn episodes (every run without
``--rollout-max-turns``) that was ~30 ms of the 1m model's 73 ms step, on the launcher's event
loop (``replayrl bench steps``). Here the same checks run as array operations over the batch's
concatenated rows, and the result is the column form of
:func:`replayrl.rollout.sample.samples_to_columns`, which
:func:`replayrl.rollout.sample.samples_from_columns` turns into samples with one contract check.

Nothing here raises on bad input: a batch it cannot take whole (a multi-turn episode, traces of
different shapes, a ``route_start``, dtypes it cannot concatenate exactly) or one that fails any
check gives ``None``, and the caller assembles each episode with
:func:`replayrl.rollout.episodes.turn_loop.assemble`, whose error names the first bad sample and
field. So the two paths agree on every batch: the same arrays
when it is good, the same error when it is not (tests/unit/rollout/test_single_turns.py).
"""
from __future__ import annotations

from typing import Any, Collection, Sequence

import numpy as np

from replayrl.rollout.engines.base import Generation
from replayrl.rollout.episodes.turn_loop import Episode
from replayrl.rollout.traces import trace_table
from replayrl.rollout.traces.trace import INT32_MAX

__all__ = ["single_turn_columns"]


def single_turn_columns(episodes: Sequence[Episode], require: Collection[str]
                        ) -> dict[str, Any] | None:
    """The per-token columns of ``N`` single-turn episodes, in order, or ``None``.

    Args:
        episodes: ``N >= 1`` :class:`replayrl.rollout.episodes.turn_loop.Episode` records.
        require: trace fields every trajectory must carry (as ``merge_turns``'s ``require``).

    Returns:
        ``None`` unless every episode has exactly one turn (a :class:`Generation`, rows from
        position 0) served at an int version, every trace is carried by all episodes or by
        none with one trailing shape, and every check ``merge_turns`` makes passes. Otherwise
        a dict of read-only arrays: ``prompt_lengths`` / ``response_lengths`` int64 ``[N]``;
        ``prompt_ids`` int32 ``[sum P]``; ``response_ids`` int32, ``loss_mask`` uint8 (all 1),
        ``rollout_logprobs`` float32, each ``[sum R]``; one entry per trace of
        ``trace_table.TRACES``: int32 ``[sum rows, ...]`` rows concatenated (``sum R`` response
        rows, ``sum (P + R - 1)`` position rows) or ``None``; ``policy_version`` int64 ``[N]``.
        Equal, trajectory by trajectory, to what ``merge_turns`` returns. (A sample's status
        comes from the episode's ``finish_reason``, which the caller reads.)
    """
    if not episodes or set(require) - {row.name for row in trace_table.TRACES}:
        return None
    turns = []
    for e in episodes:
        if len(e.turns) != 1 or e.observations or len(e.versions) != 1 \
                or type(e.versions[0]) is not int:
            return None
        turn = e.turns[0]
        start = getattr(turn, "route_start", 0)
        if type(turn) is not Generation or type(start) is not int or start != 0 \
                or not isinstance(turn.finish_reason, str):
            return None
        turns.append(turn)
    try:  # whatever these arrays are, a batch they do not fit goes back to merge_turns
        return _columns(episodes, turns, require)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _columns(episodes: Sequence[Episode], turns: list[Generation], require: Collection[str]
             ) -> dict[str, Any] | None:
    """:func:`single_turn_columns` once every episode is one :class:`Generation` turn."""
    prompt_ids = _token_ids([np.asarray(e.prompt_ids) for e in episodes])
    response_ids = _token_ids([np.asarray(t.response_ids) for t in turns])
    if prompt_ids is None or response_ids is None:
        return None
    (prompt_ids, P), (response_ids, R) = prompt_ids, response_ids
    logprobs = [np.asarray(t.rollout_logprobs) for t in turns]
    if any(lp.shape != (n,) or lp.dtype.kind not in "iuf" for lp, n in zip(logprobs, R.tolist())):
        return None
    rollout_logprobs = np.concatenate(logprobs).astype(np.float64)  # as merge_turns reads them
    if not np.isfinite(rollout_logprobs).all():
        return None
    columns: dict[str, Any] = {
        "prompt_lengths": P, "response_lengths": R, "prompt_ids": prompt_ids,
        "response_ids": response_ids, "loss_mask": np.ones(len(response_ids), np.uint8),
        "rollout_logprobs": rollout_logprobs.astype(np.float32),
        "policy_version": np.array([e.versions[0] for e in episodes], dtype=np.int64),
    }
    for row in trace_table.TRACES:
        column = _trace_column(row, [getattr(t, row.name) for t in turns],
                               trace_table.rows_in(row, P, R), row.name in require)
        if column is False:
            return None
        columns[row.name] = column
    support = columns.get("sample_support")
    if support is not None and (support.shape[1] < 1 or (support[:, 0] != response_ids).any()):
        return None  # column 0 must be the sampled ids
    for value in columns.values():
        if value is not None:
            value.flags.writeable = False
    return columns


def _exact_ints(arrays: list[np.ndarray]) -> np.ndarray | None:
    """The arrays concatenated with every value kept exactly (int64 where their dtypes differ),
    or ``None`` when one is not an integer array or is uint64 (which int64 cannot hold)."""
    dtypes = {a.dtype for a in arrays}
    if any(d.kind not in "iu" or d == np.uint64 for d in dtypes):
        return None
    if len(dtypes) > 1:  # numpy would mix some of them into float64
        arrays = [a.astype(np.int64) for a in arrays]
    return np.concatenate(arrays)


def _token_ids(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(ids int32 [sum n], lengths int64 [N])`` of ``N`` non-empty 1-d token id arrays with
    ids in ``[0, 2**31)``; ``None`` otherwise."""
    if any(a.ndim != 1 or not len(a) for a in arrays):
        return None
    ids = _exact_ints(arrays)
    if ids is None or ids.min() < 0 or ids.max() > INT32_MAX:
        return None
    return ids.astype(np.int32), np.array([len(a) for a in arrays], dtype=np.int64)


def _trace_column(row: trace_table.TraceSpec, values: list[Any], rows: np.ndarray,
                  required: bool) -> np.ndarray | None | bool:
    """One trace's column: ``None`` when no turn carries it (and it is not ``required``),
    the rows concatenated as int32 when every turn carries it with ``rows`` rows, one trailing
    shape and values in ``[-1, 2**31)``; ``False`` for anything else (the batch goes back to
    ``merge_turns``)."""
    present = [v is not None for v in values]
    if not any(present):
        return None if not required else False
    if not all(present):
        return False
    arrays = [np.asarray(v) for v in values]
    if any(a.ndim != row.ndim for a in arrays):
        return False
    if len({a.shape[1:] for a in arrays}) != 1 or any(
            len(a) != n for a, n in zip(arrays, rows.tolist())):
        return False
    column = _exact_ints(arrays)
    if column is None or (column.size and (column.min() < -1 or column.max() > INT32_MAX)):
        return False
    return column.astype(np.int32)
