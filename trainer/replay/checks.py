"""Checks and metrics of a replayed forward: routing (R3) and indexer traces against own choices.

The engine captures, per forwarded position, the experts every MoE router used and the keys
every sparse-attention indexer kept: traces ``[T, L, K]`` whose layer axis follows
``config.moe_layers`` / ``config.indexed_layers`` (global layer ids in increasing order; dense
layers have no column). The trainer replays them (``rollout/model/qwen3_moe.py``); this module
checks, on the live path, that the replay did what it should:

* All ``-1`` rows mean "no replay here, use the layer's own choice" (observation tokens, a
  synthetic EOS, padding; ``rollout/model/qwen3_moe.py`` implements the same rule);
  :func:`replayed_rows` finds them.
* :func:`check_replay` compares the choices a replayed forward used with the ones its routers /
  indexers would have made themselves and raises :class:`ReplayMismatch` when they disagree
  more than numerics can explain (a misaligned or mis-registered trace); :func:`flip_rate` and
  :func:`batch_flip_rate` are the matching metrics (the trainer's ``*_flip_rate`` /
  ``*_drift_rate``).

Replay on a split model (the PP layer registry, SP slicing, filling ``-1`` rows for a router
that cannot take them) lives in :mod:`replayrl.trainer.parallel.replay_registry` and shares
:class:`ReplayError`.

Source: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers" (R3), as implemented in slime / Megatron-LM routing replay; docs/design/traces.md#trace-arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from replayrl.trainer.errors import ReplayError, ReplayMismatch

__all__ = [
    "Mismatch",
    "ReplayCheck",
    "replayed_rows",
    "check_replay",
    "flip_rate",
    "batch_flip_rate",
    "mean_rates",
]


@dataclass(frozen=True)
class Mismatch:
    """One (token, layer) row whose replayed choice differs from the layer's own choice.

    token: row index along the token axis of the checked arrays; layer: global layer id (or the
    column index when no ids were given); used / own: sorted valid (>= 0) entries of each row.
    """

    token: int
    layer: int
    used: tuple[int, ...]
    own: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class ReplayCheck:
    """Result of :func:`check_replay` (read-only arrays).

    Attributes:
        overlap: float64 [T, L], ``|used ∩ own| / max(|used|, |own|)`` per checked row (``K``
            in the denominator for full routing rows), NaN where the row is not checked.
        token_min_overlap: float64 [T], minimum over the token's checked rows, NaN if none.
        min_overlap: minimum of ``token_min_overlap`` (NaN when no row was checked).
        n_tokens: tokens with at least one checked row; n_rows: checked (token, layer) rows.
        mismatched_tokens: checked tokens with at least one row whose sets differ.
        mismatch_fraction: ``mismatched_tokens / n_tokens`` (NaN when ``n_tokens == 0``).
        mismatches: the first mismatching rows in (token, layer) order, at most ``max_listed``.
    """

    overlap: np.ndarray
    token_min_overlap: np.ndarray
    min_overlap: float
    n_tokens: int
    n_rows: int
    mismatched_tokens: int
    mismatch_fraction: float
    mismatches: tuple[Mismatch, ...]


# --------------------------------------------------------------------------- helpers


def _int_id(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ReplayError(f"{name} must be an int, got {value!r}")
    return int(value)


def _as_numpy(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    elif not isinstance(x, np.ndarray):
        raise ReplayError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")
    return x


def _check_trace(x: Any, name: str, min_ndim: int = 2) -> np.ndarray:
    a = _as_numpy(x, name)
    if a.ndim < min_ndim or a.dtype.kind not in "iu":
        raise ReplayError(f"{name} must be an integer array with >= {min_ndim} dims [..., K], got "
                          f"shape {a.shape} and dtype {a.dtype}")
    if a.size and int(a.min()) < -1:
        raise ReplayError(f"{name} holds values < -1 (only -1 marks an empty slot): min {int(a.min())}")
    return a


def _set_overlap(used: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``[..., K]`` int arrays: (|U ∩ O|, |U|, |O|) over the distinct entries >= 0.

    Linear memory in the number of entries (no [rows, K, K] broadcast, so indexer rows of
    thousands of keys are fine): each entry becomes the key ``row * M + value``, unique per row.
    """
    shape = used.shape[:-1]
    rows = int(np.prod(shape, dtype=np.int64))
    if rows == 0 or used.shape[-1] == 0:
        z = np.zeros(shape, np.int64)
        return z, z.copy(), z.copy()
    u = used.reshape(rows, -1).astype(np.int64)
    o = own.reshape(rows, -1).astype(np.int64)
    m = int(max(u.max(), o.max(), 0)) + 1
    row_id = np.arange(rows, dtype=np.int64)[:, None]
    u_keys = np.unique((row_id * m + u)[u >= 0])
    o_keys = np.unique((row_id * m + o)[o >= 0])
    hit = np.isin(u_keys, o_keys, assume_unique=True)
    inter = np.bincount(u_keys[hit] // m, minlength=rows)
    n_u = np.bincount(u_keys // m, minlength=rows)
    n_o = np.bincount(o_keys // m, minlength=rows)
    return inter.reshape(shape), n_u.reshape(shape), n_o.reshape(shape)


def _pair(used: Any, own: Any) -> tuple[np.ndarray, np.ndarray]:
    u = _check_trace(used, "used", 3)
    o = _check_trace(own, "own", 3)
    if u.ndim != 3 or u.shape != o.shape:
        raise ReplayError(f"used and own must both be [T, L, K] of one shape, got {u.shape} and "
                          f"{o.shape} (flatten batch and sequence axes first)")
    return u, o


# --------------------------------------------------------------------------- -1 rows


def replayed_rows(trace: Any) -> Any:
    """Bool ``[...]`` (the trace shape without ``K``): True where the row replays something.

    A row of only ``-1`` is "no replay: use the layer's own choice".
    """
    if isinstance(trace, torch.Tensor):
        return (trace >= 0).any(-1)
    return (_as_numpy(trace, "trace") >= 0).any(-1)


# --------------------------------------------------------------------------- checks / metrics


def _check_fraction(value: float, name: str) -> float:
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ReplayError(f"{name} must lie in [0, 1], got {value!r}")
    return v


def check_replay(used: Any, own: Any, loss_rows_mask: Any | None, min_overlap_ratio: float,
                 max_mismatch_fraction: float, *, layer_ids: Sequence[int] | None = None,
                 kind: str = "routing", max_listed: int = 8) -> ReplayCheck:
    """Compare replayed choices with the layers' own choices; raise when they disagree too much.

    Per checked row (token ``t``, layer ``l``) the overlap is ``|U ∩ O| / max(|U|, |O|)`` over
    the distinct entries ``>= 0`` of ``U = used[t, l]`` and ``O = own[t, l]`` (``= |U ∩ O| / K``
    for full routing rows). A row is checked when ``used`` replays it (not all ``-1``) and
    ``loss_rows_mask[t]``. Per token, the minimum overlap over its checked rows; a token
    mismatches when any of its rows' sets differ.

    Args:
        used: int [T, L, K] choices the forward used (e.g. ``CausalLMOutput.routed_experts``,
            batch and sequence axes flattened).
        own: int [T, L, K] choices the routers / indexers would make themselves
            (``own_routed_experts``).
        loss_rows_mask: bool [T] rows that matter (e.g. real tokens), or None for all.
        min_overlap_ratio: in [0, 1]; fail when the minimum per-token overlap is below it.
        max_mismatch_fraction: in [0, 1]; fail when the fraction of checked tokens with any
            mismatch exceeds it.
        layer_ids: global layer id of each column, for the report (default: column index).
        kind: "routing" / "indexer", for the message; max_listed: mismatches to list.

    Returns:
        :class:`ReplayCheck`. With no checked row nothing can fail: ``n_tokens == 0`` and the
        overlap / fraction are NaN.

    Raises:
        ReplayMismatch: a bound is violated (message lists the first mismatches:
            token, layer, used vs own).
        ReplayError: bad shapes, values < -1, or thresholds outside [0, 1].
    """
    u, o = _pair(used, own)
    t_rows, n_layers, _ = u.shape
    min_ratio = _check_fraction(min_overlap_ratio, "min_overlap_ratio")
    max_frac = _check_fraction(max_mismatch_fraction, "max_mismatch_fraction")
    ids = list(range(n_layers)) if layer_ids is None else [_int_id(i, "layer id") for i in layer_ids]
    if len(ids) != n_layers:
        raise ReplayError(f"{len(ids)} layer_ids for {n_layers} trace columns")
    if loss_rows_mask is None:
        rows_mask = np.ones(t_rows, bool)
    else:
        rows_mask = _as_numpy(loss_rows_mask, "loss_rows_mask")
        if rows_mask.dtype != np.bool_ or rows_mask.shape != (t_rows,):
            raise ReplayError(f"loss_rows_mask must be bool [{t_rows}], got shape {rows_mask.shape} "
                              f"and dtype {rows_mask.dtype}")
    inter, n_u, n_o = _set_overlap(u, o)
    checked = (n_u > 0) & rows_mask[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        overlap = np.where(checked, inter / np.maximum(np.maximum(n_u, n_o), 1), np.nan)
    differ = checked & ((inter != n_u) | (inter != n_o))
    token_checked = checked.any(1)
    token_min = np.full(t_rows, np.nan)
    if token_checked.any():
        token_min[token_checked] = np.nanmin(overlap[token_checked], axis=1)
    n_tokens = int(token_checked.sum())
    mismatched = int(differ.any(1).sum())
    listed = []
    for t, layer in zip(*np.nonzero(differ)):
        if len(listed) == max_listed:
            break
        listed.append(Mismatch(int(t), ids[layer], tuple(sorted(set(u[t, layer][u[t, layer] >= 0].tolist()))),
                               tuple(sorted(set(o[t, layer][o[t, layer] >= 0].tolist())))))
    for a in (overlap, token_min):
        a.flags.writeable = False
    check = ReplayCheck(
        overlap=overlap, token_min_overlap=token_min,
        min_overlap=float(np.nanmin(token_min)) if n_tokens else math.nan,
        n_tokens=n_tokens, n_rows=int(checked.sum()), mismatched_tokens=mismatched,
        mismatch_fraction=mismatched / n_tokens if n_tokens else math.nan,
        mismatches=tuple(listed))
    if n_tokens and (check.min_overlap < min_ratio or check.mismatch_fraction > max_frac):
        raise ReplayMismatch(kind, check, min_ratio, max_frac)
    return check


def flip_rate(used: Any, own: Any, valid_rows: Any) -> float:
    """Fraction of valid (token, layer) rows whose used and own index SETS differ.

    Args:
        used, own: int [T, L, K] (numpy or torch), ``-1`` = empty slot.
        valid_rows: bool [T, L], or bool [T] applied to every layer (e.g.
            ``replayed_rows(used) & real_token[:, None]``).

    Returns:
        a float in [0, 1]; NaN when no row is valid (the metric is undefined, not 0).

    Raises:
        ReplayError: bad shapes or values.
    """
    u, o = _pair(used, own)
    valid = _as_numpy(valid_rows, "valid_rows")
    if valid.dtype != np.bool_ or valid.shape not in (u.shape[:1], u.shape[:2]):
        raise ReplayError(f"valid_rows must be bool {list(u.shape[:1])} or {list(u.shape[:2])}, got "
                          f"shape {valid.shape} and dtype {valid.dtype}")
    if valid.ndim == 1:
        valid = np.broadcast_to(valid[:, None], u.shape[:2])
    n = int(valid.sum())
    if n == 0:
        return math.nan
    return float((_rows_differ(u, o) & valid).sum() / n)


def _rows_differ(u: np.ndarray, o: np.ndarray) -> np.ndarray:
    """Bool ``[...]``: whether the sets of entries ``>= 0`` of each row of ``u`` / ``o`` differ.

    Rows without a repeated entry (router rows, indexer rows: always so) have equal sets
    exactly when their sorted rows are equal (equal sets then hold as many ``-1`` as each
    other), which is one sort instead of :func:`_set_overlap`'s hashing; rows with repeats
    take the general path.
    """
    su, so = np.sort(u, axis=-1), np.sort(o, axis=-1)
    repeats = any(bool(((x[..., 1:] == x[..., :-1]) & (x[..., 1:] >= 0)).any()) for x in (su, so))
    if not repeats:
        return (su != so).any(-1)
    inter, n_u, n_o = _set_overlap(u, o)
    return (inter != n_u) | (inter != n_o)


def batch_flip_rate(engine: torch.Tensor, other: torch.Tensor, real: torch.Tensor) -> float:
    """:func:`flip_rate` of batched choices against the engine's captured ones.

    Args:
        engine, other: int [B, T, L, K] (the engine's trace, -1 rows = not captured; the
            choices to compare: used or own).
        real: bool [B, T], real (non-padding) tokens.

    Returns:
        fraction of captured real (token, layer) rows whose sets differ; NaN if none.
    """
    e = engine.reshape(-1, *engine.shape[2:])
    return flip_rate(e, other.reshape(-1, *other.shape[2:]), replayed_rows(e) & real.reshape(-1)[:, None])


def mean_rates(rates: Mapping[str, Sequence[float]]) -> dict[str, float | None]:
    """Step metrics from per-microbatch rates: the mean of each list, ignoring NaN entries.

    A NaN entry is a microbatch without a captured real row (:func:`batch_flip_rate`). A list
    of only NaN (e.g. traces of only ``-1`` rows: nothing captured, nothing compared) reports
    ``None``: the metric is undefined (``null`` in ``metrics.jsonl``, ``n/a`` in the progress
    line), never 0.0, which would claim a perfect replay that never happened.

    Args:
        rates: metric name -> per-microbatch values in [0, 1] or NaN (e.g.
            ``{"routing_flip_rate": [0.0, 0.01]}``).

    Returns:
        metric name -> float, or None when no entry is a number, in the order of ``rates``.
    """
    return {k: float(np.nanmean(v)) if not np.isnan(v).all() else None for k, v in rates.items()}
