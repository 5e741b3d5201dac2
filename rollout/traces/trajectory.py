"""Trajectory transformations that keep every per-token array aligned.

Pure functions: a :class:`replayrl.rollout.sample.Sample` is frozen, so each returns a new one (or a new
:class:`MergedTrajectory`) and never touches its input. Row spaces (docs/design/sample-contract.md#sample-contract):
``response_ids``, ``loss_mask``, ``rollout_logprobs`` and ``sample_support`` have
``R`` rows; ``routed_experts`` and ``indexer_topk`` have ``P + R - 1`` rows, one per forwarded
position (the last token is never forwarded).

* :func:`truncate` -- keep the first ``n`` response tokens and the rows that belong to them.
* :func:`append_synthetic_eos` -- end a length-truncated response with an EOS the engine never
  sampled (at most one per trajectory).
* :func:`merge_turns` -- one trajectory from engine turns and environment observations,
  through :class:`replayrl.rollout.traces.trace.TokenMetadataTrace` (every trajectory, single- or multi-turn).

Conventions for rows nobody captured: support rows of observation tokens are all ``-1``
(column 0 included: a padding row to the trainer, ``trainer/loss/logprobs.py``); routing / indexer
rows nobody computed are all ``-1``, which the model reads as "no replay, use your own choice"
(``rollout/model/qwen3_moe.py``). Nothing is ever filled with zeros: expert 0 / key 0 would
be replayed as if the engine had chosen them.

Every error is a :class:`TrajectoryError` (a ``SampleError``) naming the sample and the field,
except a required trace never captured: :class:`replayrl.rollout.errors.MissingTraceError`.
Which traces exist, and in which row space, is read from ``replayrl.rollout.traces.trace_table.TRACES``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Collection, Literal, Mapping, Sequence

import numpy as np

from replayrl.rollout.errors import MissingTraceError, TraceGapError, TrajectoryError
from replayrl.rollout.sample import Sample
from replayrl.rollout.traces import trace_table
from replayrl.rollout.traces.capture import check_route_offset, check_sampled_logprob
from replayrl.rollout.traces.trace import INT32_MAX, TokenMetadataTrace
from replayrl.rollout.traces.trace_table import trace_fields

__all__ = [
    "OBSERVATION_LOGPROB",
    "SYNTHETIC_EOS_LOGPROB",
    "MergedTrajectory",
    "truncate",
    "append_synthetic_eos",
    "merge_turns",
]

# Finite placeholders in rollout_logprobs for rows the engine never sampled. Observation rows
# have loss_mask 0 so no gate or loss reads them; 0.0 rather than NaN keeps masked arithmetic
# (NaN * 0 = NaN) safe in any consumer. The synthetic EOS row is loss-bearing: the trainer
# recognises it by `synthetic_eos` and its all -1 support row and uses the full-vocabulary
# fallback; the placeholder only has to be finite to satisfy the Sample contract. It is not a
# behaviour logprob: Sample.sampled_mask leaves the row out of every RS gate, TIS weight and
# logprob metric (docs/design/trainer-math.md#trainer-math,
# docs/design/rejection-sampling.md#rejection-sampling), so its value never matters.
OBSERVATION_LOGPROB = 0.0
SYNTHETIC_EOS_LOGPROB = 0.0


def _copy_rows(arr: np.ndarray | None, n: int) -> np.ndarray | None:
    return None if arr is None else np.array(arr[:n])


def truncate(sample: Sample, max_response_len: int) -> Sample:
    """Keep the first ``max_response_len`` response tokens and every row that belongs to them.

    ``response_ids``, ``loss_mask``, ``rollout_logprobs`` and ``sample_support`` keep
    ``n = min(R, max_response_len)`` rows; ``routed_experts`` and ``indexer_topk`` keep
    ``P + n - 1`` (every trace by its row space in ``trace_table.TRACES``) (case
    ``truncate_keeps_traces_aligned``: P=6, R=12, n=7 -> 7 and 12 rows).

    Returns:
        ``sample`` itself when ``R <= max_response_len`` (nothing to cut; samples are
        immutable). Otherwise a new Sample with status ``"truncated"`` (``"aborted"`` stays
        aborted) and ``synthetic_eos`` False (a synthetic EOS is always the last token, so
        cutting anything removes it). ``reward`` is copied unchanged: a caller that truncates
        after scoring must re-score.

    Raises:
        TrajectoryError (field ``max_response_len``): not an int >= 0.
        SampleError: the result violates the contract (cannot happen for a valid input).
    """
    if isinstance(max_response_len, bool) or not isinstance(max_response_len, (int, np.integer)) \
            or max_response_len < 0:
        raise TrajectoryError(sample.sample_id, "max_response_len",
                              f"must be an int >= 0, got {max_response_len!r}")
    n = int(max_response_len)
    R = len(sample.response_ids)
    if R <= n:
        return sample
    P = len(sample.prompt_ids)
    return dataclasses.replace(
        sample,
        response_ids=np.array(sample.response_ids[:n]),
        loss_mask=np.array(sample.loss_mask[:n]),
        rollout_logprobs=np.array(sample.rollout_logprobs[:n]),
        **{row.name: _copy_rows(getattr(sample, row.name), int(trace_table.rows_in(row, P, n)))
           for row in trace_table.TRACES},
        status="aborted" if sample.status == "aborted" else "truncated",
        synthetic_eos=False,
    )


def _with_pad_row(arr: np.ndarray | None, row: trace_table.TraceSpec) -> np.ndarray | None:
    """``arr`` with one more row of the trace's padding value (``None`` stays ``None``)."""
    if arr is None:
        return None
    extra = np.full((1, *arr.shape[1:]), row.pad, dtype=row.dtype)
    return np.concatenate([arr, extra], axis=0)


def append_synthetic_eos(sample: Sample, eos_id: int) -> Sample:
    """Append one EOS token the engine did not sample (docs/design/traces.md#trace-arrays).

    Used when a response hit its length cap: training on the EOS teaches the policy to stop.
    The run applies it with ``--rollout-append-eos-on-truncation`` (``rollout/dispatch/manager.py``,
    before scoring). The trainer trains the row with no behaviour ratio (TIS weight 1) and
    keeps it out of every RS gate (:attr:`replayrl.rollout.sample.Sample.sampled_mask`).
    New last row of every row space:

    * ``response_ids`` += ``eos_id``; ``loss_mask`` += 1; ``rollout_logprobs`` +=
      :data:`SYNTHETIC_EOS_LOGPROB` (finite placeholder; ``synthetic_eos=True`` makes the
      trainer use the full-vocabulary logprob for this row);
    * ``sample_support`` += ``[eos_id, -1, ..., -1]`` (sampled id, no captured candidates);
    * ``routed_experts`` / ``indexer_topk`` (every position-row trace) += one all ``-1`` row
      (the trace's padding value): it is the row of the
      *previous* last token (position ``P + R - 1``), which the engine sampled but never
      forwarded, so there is no choice to replay and the trainer uses its own.

    Case ``truncated_then_synthetic_eos``: ``[5, 6, 7, 8]`` + EOS 2 with top_k 3 gives 5
    support rows, the last ``[2, -1, -1, -1]``.

    Raises:
        TrajectoryError: ``synthetic_eos`` already set (field ``synthetic_eos``: at most one per
            trajectory); ``eos_id`` not an int >= 0 (field ``eos_id``); the response already
            ends with a sampled ``eos_id`` (field ``response_ids``).
        SampleError: another loss-bearing row without support exists (Sample's own check:
            case ``two_unsupported_rows``).
    """
    sid = sample.sample_id
    if sample.synthetic_eos:
        raise TrajectoryError(sid, "synthetic_eos",
                              "already ends with a synthetic EOS: at most one per trajectory")
    if isinstance(eos_id, bool) or not isinstance(eos_id, (int, np.integer)) or eos_id < 0:
        raise TrajectoryError(sid, "eos_id", f"must be an int >= 0, got {eos_id!r}")
    eos = int(eos_id)
    if len(sample.response_ids) and int(sample.response_ids[-1]) == eos:
        raise TrajectoryError(sid, "response_ids", f"already ends with a sampled EOS {eos}")
    # every trace gets one padding row (nothing captured for the new token, or for the
    # previous last token's position, never forwarded)
    traces = {row.name: _with_pad_row(getattr(sample, row.name), row) for row in trace_table.TRACES}
    if traces.get("sample_support") is not None:
        traces["sample_support"][-1, 0] = eos  # the support's column 0 is the sampled id
    return dataclasses.replace(
        sample,
        response_ids=np.append(sample.response_ids, np.int32(eos)),
        loss_mask=np.append(sample.loss_mask, np.uint8(1)),
        rollout_logprobs=np.append(sample.rollout_logprobs, np.float32(SYNTHETIC_EOS_LOGPROB)),
        **traces,
        synthetic_eos=True,
    )


@dataclass(frozen=True, eq=False)  # eq on arrays would be ambiguous
@trace_fields(before="finish_reason")
class MergedTrajectory:
    """The response side of one multi-turn trajectory (output of :func:`merge_turns`).

    With ``P`` prompt tokens and ``R`` = generated plus observation tokens (read-only arrays):

    Fields:
        response_ids: int32 ``[R]``: turn 0, observation 0, turn 1, ..., last turn.
        loss_mask: uint8 ``[R]``: 1 on generated tokens, 0 on observation tokens.
        rollout_logprobs: float32 ``[R]``: the engine's logprobs; :data:`OBSERVATION_LOGPROB`
            on observation tokens.
        sample_support: int32 ``[R, 1+W]`` or None; observation rows all ``-1``.
        routed_experts: int32 ``[P+R-1, L, K]`` or None; row ``t`` from the turn whose engine
            forward first computed position ``t`` (see :func:`merge_turns`).
        indexer_topk: int32 ``[P+R-1, L_idx, K_idx]`` or None; same rows as routed_experts.
            (One such field per row of ``trace_table.TRACES``, keyword-only, default None:
            response-row traces as sample_support, position-row traces as routed_experts.)
        finish_reason: the last kept turn's finish reason (e.g. ``"stop"`` / ``"length"``).
        num_turns: turns kept.
        dropped_turns: turns dropped at a trace gap (only with ``on_trace_gap="keep_prefix"``);
            a caller should then mark the sample ``"truncated"``.
    """

    response_ids: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    finish_reason: str
    num_turns: int
    dropped_turns: int = 0

    def sample_fields(self) -> dict[str, np.ndarray | None]:
        """The per-token fields (three arrays and every trace) as keyword arguments of
        :class:`replayrl.rollout.sample.Sample`."""
        return {name: getattr(self, name) for name in
                ("response_ids", "loss_mask", "rollout_logprobs",
                 *(row.name for row in trace_table.TRACES))}


def _get(record: Any, name: str, default: Any = None) -> Any:
    if isinstance(record, Mapping):
        return record.get(name, default)
    return getattr(record, name, default)


def _ids(sid: Any, field: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TrajectoryError(sid, field, f"expected 1-d integer token ids, got {arr.dtype} {arr.shape}")
    if arr.size and int(arr.min()) < 0:
        raise TrajectoryError(sid, field, f"negative token id {int(arr.min())}")
    if arr.size and int(arr.max()) > INT32_MAX:  # int32 would wrap it into another token
        raise TrajectoryError(sid, field, f"token id {int(arr.max())} does not fit int32")
    return arr.astype(np.int32)


def _trace_names() -> tuple[str, ...]:
    return tuple(row.name for row in trace_table.TRACES)


def _present(turn: Any) -> set[str]:
    return {name for name in _trace_names() if _get(turn, name) is not None}


def merge_turns(
    prompt_ids: Sequence[int],
    turns: Sequence[Any],
    observations: Sequence[Sequence[int]],
    *,
    sample_id: Any,
    require: Collection[str] = (),
    on_trace_gap: Literal["raise", "keep_prefix"] = "raise",
) -> MergedTrajectory:
    """Assemble one multi-turn trajectory: turn 0, observation 0, turn 1, ..., turn n-1.

    Args:
        prompt_ids: the ``P`` tokens of the original prompt.
        turns: ``n >= 1`` engine turn records, objects or mappings with the fields of
            :class:`replayrl.rollout.engines.base.Generation`: ``response_ids`` int ``[R_k >= 1]``,
            ``rollout_logprobs`` float ``[R_k]`` (finite), ``finish_reason`` str, optional
            ``sample_support`` ``[R_k, 1+W]``, optional ``routed_experts`` / ``indexer_topk``
            with one row per position the engine forwarded, and optional ``route_start``
            (default 0): the context position of the first per-position row (an external
            engine asked for rows from an offset, :func:`replayrl.rollout.traces.capture.check_route_offset`).
            Turn ``k`` was generated from the context ``C_k`` = prompt + everything before it,
            so it carries ``len(C_k) + R_k - 1 - route_start`` per-position rows.
        observations: ``n - 1`` token sequences, observation ``k`` following turn ``k``.
        sample_id: named in every error.
        require: trace fields that are enabled and must be present (e.g. ``routed_experts``
            with R3 on). Case ``missing_trace_when_enabled``: a trajectory without one is an
            error here, at conversion time, never a sample silently trained without replay.
        on_trace_gap: what to do when turn ``k > 0`` lacks a trace turn 0 carries (case
            ``merge_stops_at_trace_gap``): ``"raise"`` (default) raises
            :class:`TraceGapError`; ``"keep_prefix"`` keeps turns ``0..k-1`` with their traces
            (observation ``k-1`` is dropped with turn ``k``) and reports ``dropped_turns``.
            Neither ever fills the gap with zeros or with ``-1`` (which would silently train
            those rows without replay).

    Row assembly (each through a :class:`replayrl.rollout.traces.trace.TokenMetadataTrace`):

    * response rows: turn ``k``'s ``R_k`` rows, then ``O_k`` observation rows (loss_mask 0,
      logprob :data:`OBSERVATION_LOGPROB`, support all ``-1``);
    * position rows: the engine re-forwards the whole context every turn, so turn ``k``
      computes rows for positions ``0 .. len(C_k) + R_k - 2``. Positions before
      ``offset_k`` = rows already taken from earlier turns are skipped; with
      ``offset_0 = 0`` and ``offset_k = len(C_k) - O_{k-1} - 1``, turn ``k`` contributes
      the last token of turn ``k-1`` (sampled but never forwarded by turn ``k-1``), the
      observation ``k-1`` tokens and its own forwarded tokens. So each position's row is the
      one the engine computed when it first forwarded that position: observation positions
      get the rows of the turn that consumed them, i.e. the routing that produced the
      key/values every later token attended to -- what the trainer's single full forward
      must replay. (An engine with a prefix cache reuses exactly those first-forward
      key/values; the embedded engine recomputes them, equal up to rounding.) Total
      ``P + R - 1`` rows.

    Returns:
        :class:`MergedTrajectory`.

    Raises:
        TrajectoryError: no turn; ``len(observations) != len(turns) - 1``; an empty turn; a
            token id negative or past int32; a row count or length mismatch (names the field
            and the turn); a turn with a trace turn 0 lacks; a ``route_start`` past the rows
            still needed.
        replayrl.rollout.errors.MissingTraceError: a field of ``require`` missing from turn 0.
        TraceGapError: a later turn lacks a trace, with ``on_trace_gap="raise"``.
        replayrl.rollout.traces.capture.CaptureError: a non-finite sampled logprob, an invalid route offset.
        replayrl.rollout.errors.TraceSchemaError: inconsistent trace shapes between turns (names the field).
    """
    sid = sample_id
    prompt = _check_merge_inputs(sid, prompt_ids, turns, observations, require, on_trace_gap)
    kept = _turns_to_keep(sid, turns, require, on_trace_gap)
    response_rows = TokenMetadataTrace(sid)  # R rows: turns' response rows, observation padding
    position_rows = TokenMetadataTrace(sid)  # P + R - 1 rows: each position's first forward
    response_ids: list[np.ndarray] = []
    loss_mask: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    context_len = len(prompt)
    for k in range(kept):
        ids, lp, chunk = _turn_response(sid, k, turns[k], first_row=sum(len(r) for r in response_ids))
        response_rows.append(chunk, rows=len(ids))
        response_ids.append(ids)
        loss_mask.append(np.ones(len(ids), np.uint8))
        logprobs.append(lp)
        chunk, rows = _turn_positions(sid, k, turns[k], context_len, len(ids), position_rows.rows)
        position_rows.append(chunk, rows=rows)
        context_len += len(ids)
        if k + 1 < kept:
            obs = _ids(sid, "observations", observations[k])
            response_rows.append_padding(len(obs))
            response_ids.append(obs)
            loss_mask.append(np.zeros(len(obs), np.uint8))
            logprobs.append(np.full(len(obs), OBSERVATION_LOGPROB, np.float32))
            context_len += len(obs)

    finish_reason = _get(turns[kept - 1], "finish_reason")
    if not isinstance(finish_reason, str):
        raise TrajectoryError(sid, "finish_reason", f"turn {kept - 1}: expected a string, got "
                                                    f"{finish_reason!r}")
    R = context_len - len(prompt)
    traces = {**response_rows.finalize(R), **position_rows.finalize(len(prompt) + R - 1)}

    def frozen(arr: np.ndarray) -> np.ndarray:
        arr.flags.writeable = False
        return arr

    return MergedTrajectory(
        response_ids=frozen(np.concatenate(response_ids)),
        loss_mask=frozen(np.concatenate(loss_mask)),
        rollout_logprobs=frozen(np.concatenate(logprobs)),
        **{name: traces.get(name) for name in _trace_names()},
        finish_reason=finish_reason,
        num_turns=kept,
        dropped_turns=len(turns) - kept,
    )


def _check_merge_inputs(sid: Any, prompt_ids: Sequence[int], turns: Sequence[Any],
                        observations: Sequence[Sequence[int]], require: Collection[str],
                        on_trace_gap: str) -> np.ndarray:
    """:func:`merge_turns`' arguments as a whole; returns the prompt as int32 ``[P >= 1]``.

    Raises:
        TrajectoryError: an unknown ``on_trace_gap`` or required trace, an empty or non-integer
            prompt, no turn, or not exactly one observation between two turns.
    """
    if on_trace_gap not in ("raise", "keep_prefix"):
        raise TrajectoryError(sid, "on_trace_gap", f"must be 'raise' or 'keep_prefix', got {on_trace_gap!r}")
    known = _trace_names()
    unknown = set(require) - set(known)
    if unknown:
        raise TrajectoryError(sid, sorted(unknown)[0], f"unknown trace; known: {known}")
    prompt = _ids(sid, "prompt_ids", prompt_ids)
    if len(prompt) == 0:
        raise TrajectoryError(sid, "prompt_ids", "empty prompt")
    if len(turns) == 0:
        raise TrajectoryError(sid, "turns", "no turn to merge")
    if len(observations) != len(turns) - 1:
        raise TrajectoryError(sid, "observations", f"{len(observations)} observations for "
                                                   f"{len(turns)} turns; expected {len(turns) - 1}")
    return prompt


def _turns_to_keep(sid: Any, turns: Sequence[Any], require: Collection[str],
                   on_trace_gap: str) -> int:
    """How many turns keep the trace schema turn 0 fixes (``len(turns)`` without a gap).

    Turn 0's traces are the trajectory's; every later turn must carry exactly those. A turn
    carrying more is an error; one carrying fewer is a trace gap (raised, or the trajectory is
    cut before it with ``on_trace_gap="keep_prefix"``).

    Raises:
        MissingTraceError: a trace of ``require`` missing from turn 0.
        TrajectoryError: a later turn carries a trace turn 0 lacks.
        TraceGapError: a later turn lacks one of turn 0's traces, with ``on_trace_gap="raise"``.
    """
    names = _trace_names()
    schema = _present(turns[0])
    missing = [name for name in names if name in require and name not in schema]
    if missing:
        raise MissingTraceError(sid, missing[0], "enabled but not captured; refusing to train "
                                                 "this trajectory without replay")
    for k in range(1, len(turns)):
        have = _present(turns[k])
        extra = sorted(have - schema)
        if extra:
            raise TrajectoryError(sid, extra[0], f"turn {k} carries it but turn 0 does not")
        gap = [name for name in names if name in schema and name not in have]
        if gap:
            if on_trace_gap == "raise":
                raise TraceGapError(sid, gap[0], f"turn {k} of {len(turns)} lacks it while turn 0 "
                                                 "carries it (trace gap)")
            return k
    return len(turns)


def _turn_response(sid: Any, k: int, turn: Any, *, first_row: int
                   ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Turn ``k``'s response rows: ``(response_ids int32 [R_k], rollout_logprobs float32
    [R_k], response-row traces {name: [R_k, ...]})``.

    Args:
        first_row: the turn's first row in the merged response (for error positions).
    Raises:
        TrajectoryError: no token, a logprob / trace row count differing from ``R_k``, a
            support whose column 0 is not the sampled ids.
        replayrl.rollout.traces.capture.CaptureError: a non-finite sampled logprob.
    """
    ids = _ids(sid, "response_ids", _get(turn, "response_ids"))
    R_k = len(ids)
    if R_k == 0:
        raise TrajectoryError(sid, "response_ids", f"turn {k} generated no token")
    try:
        lp = np.asarray(_get(turn, "rollout_logprobs"), dtype=np.float64)
    except (TypeError, ValueError) as exc:  # ragged, or not numbers
        raise TrajectoryError(sid, "rollout_logprobs", f"turn {k}: not a float array: {exc}") from None
    if lp.shape != (R_k,):
        raise TrajectoryError(sid, "rollout_logprobs",
                              f"turn {k}: shape {lp.shape} != response length ({R_k},)")
    for j in np.flatnonzero(~np.isfinite(lp))[:1]:
        check_sampled_logprob(lp[j], sid, first_row + int(j))  # raises, naming the position
    chunk = {}
    for row in trace_table.TRACES:
        arr = _get(turn, row.name) if row.rows == "response" else None
        if arr is None:
            continue
        arr = np.asarray(arr)
        if arr.ndim != row.ndim or arr.shape[0] != R_k:
            raise TrajectoryError(sid, row.name, f"turn {k}: shape {arr.shape}, expected "
                                                 f"({R_k}, {', '.join(row.shape)})")
        if row.name == "sample_support" and (arr.shape[1] < 1 or (arr[:, 0] != ids).any()):
            raise TrajectoryError(sid, row.name,
                                  f"turn {k}: column 0 (the sampled ids) missing or not response_ids")
        chunk[row.name] = arr
    return ids, lp.astype(np.float32), chunk


def _turn_positions(sid: Any, k: int, turn: Any, context_len: int, R_k: int,
                    offset: int) -> tuple[dict[str, np.ndarray], int]:
    """Turn ``k``'s new position rows: ``({name: [rows, ...]}, rows)``.

    The turn's engine forward covered positions ``0 .. context_len + R_k - 2`` (its rows start
    at ``route_start``); the first ``offset`` positions were taken from earlier turns, so the
    turn contributes positions ``offset .. context_len + R_k - 2`` (see :func:`merge_turns`).

    Raises:
        TrajectoryError: a ``route_start`` past ``offset``, a row count other than
            ``context_len + R_k - 1 - route_start``.
        replayrl.rollout.traces.capture.CaptureError: an invalid offset or ``route_start``.
    """
    check_route_offset(offset, context_len, sample_id=sid)
    route_start = _get(turn, "route_start", 0)
    route_start = check_route_offset(route_start, context_len, sample_id=sid)
    if route_start > offset:
        raise TrajectoryError(sid, "route_start",
                              f"turn {k}: rows start at position {route_start} but position "
                              f"{offset} is not covered by earlier turns")
    forwarded = context_len + R_k - 1  # positions this turn's engine forward covered
    chunk = {}
    for row in trace_table.TRACES:
        arr = _get(turn, row.name) if row.rows == "position" else None
        if arr is None:
            continue
        arr = np.asarray(arr)
        if arr.ndim < 1 or arr.shape[0] != forwarded - route_start:
            raise TrajectoryError(
                sid, row.name, f"turn {k}: {arr.shape[0] if arr.ndim else 0} rows, expected "
                               f"{forwarded - route_start} (context {context_len} + R_k {R_k} - 1 "
                               f"- route_start {route_start})")
        chunk[row.name] = arr[offset - route_start:]
    return chunk, forwarded - offset
