"""Replay managers for routing (R3) and indexer traces: layer registry, SP slicing, checks.

The engine captures, per forwarded position, the experts every MoE router used and the keys
every sparse-attention indexer kept: traces ``[T, L, K]`` whose layer axis follows
``config.moe_layers`` / ``config.indexed_layers`` (global layer ids in increasing order; dense
layers have no column). The trainer replays them; this module keeps that replay correct when
the model is split:

* :class:`ReplayRegistry` maps GLOBAL layer ids to trace columns. Megatron-style routing replay
  (slime's R3 ``RoutingReplay``) appends one replay object per router in construction order and
  indexes the captured trace with that counter, which silently reads another layer's column on
  every pipeline stage but the first (each stage constructs only its own layers) and whenever
  dense layers are interleaved. Here a stage registers the global ids of its local layers
  (an explicit list, or ``pp_rank`` and ``layers_per_stage``) and reads each stream by id.
* :func:`sp_slice` gives a sequence-parallel (SP) rank the rows of a replayed trace that match
  its slice of the activations: the same split as ``torch.chunk(x, sp_size, dim)`` (Megatron's
  ``scatter_to_sequence_parallel_region``), so token ``t``'s router sees token ``t``'s replay.
* All ``-1`` rows mean "no replay here, use the layer's own choice" (observation tokens, a
  synthetic EOS, padding; ``rollout/model/qwen3_moe.py`` implements the same rule).
  :func:`replayed_rows` finds them; :func:`fill_own_choice` substitutes the own choice for a
  backend whose router cannot take ``-1`` (gathering router probabilities at ``-1`` or masking
  every key of an attention row would give NaN gradients).
* :func:`check_replay` compares the choices a replayed forward used with the ones its routers /
  indexers would have made themselves and raises :class:`ReplayMismatch` when they disagree
  more than numerics can explain (a misaligned or mis-registered trace); :func:`flip_rate` is
  the matching metric.

Source: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers" (R3), as implemented in slime / Megatron-LM routing replay; DESIGN.md,
"trace" table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

__all__ = [
    "ReplayError",
    "ReplayMismatch",
    "Mismatch",
    "ReplayCheck",
    "ReplayRegistry",
    "sp_slice",
    "replayed_rows",
    "fill_own_choice",
    "check_replay",
    "flip_rate",
]


class ReplayError(ValueError):
    """Bad input to a replay manager: layer ids, trace shapes, SP rank, thresholds."""


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


class ReplayMismatch(ReplayError):
    """The replayed choices disagree with the layers' own choices beyond the allowed bounds.

    Attributes:
        check: the :class:`ReplayCheck` that failed (overlaps, fractions, first mismatches).
    """

    def __init__(self, kind: str, check: "ReplayCheck", min_overlap_ratio: float,
                 max_mismatch_fraction: float) -> None:
        self.check = check
        listed = "; ".join(f"token {m.token} layer {m.layer}: used {list(m.used)} own {list(m.own)}"
                           for m in check.mismatches)
        super().__init__(
            f"{kind} replay mismatch: min per-token overlap {check.min_overlap:.3f} "
            f"(allowed >= {min_overlap_ratio}), {check.mismatched_tokens}/{check.n_tokens} tokens "
            f"with a mismatch = {check.mismatch_fraction:.3f} (allowed <= {max_mismatch_fraction}); "
            f"first mismatches: {listed}")


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


# --------------------------------------------------------------------------- registry


class ReplayRegistry:
    """Which replay streams (trace columns) this model part owns, keyed by GLOBAL layer id.

    ``trace_layers`` lists the global ids that have a column in the full trace, in column order
    (``config.moe_layers`` for routing, ``config.indexed_layers`` for the indexer); the full
    trace is ``[..., L_total, K]`` with the layer axis second to last (``[T, L, K]`` packed,
    ``[B, S, L, K]`` padded). Layers register themselves (a model part builds its layers, then
    calls :meth:`register` or :meth:`register_stage`), so the registry is mutable until every
    layer of the part has registered; a layer registers at most once.

    Raises:
        ReplayError: ``trace_layers`` not distinct ids in ``[0, num_layers)`` in increasing order.
    """

    def __init__(self, trace_layers: Sequence[int], num_layers: int, *, kind: str = "routing") -> None:
        self.num_layers = _int_id(num_layers, "num_layers")
        if self.num_layers < 1:
            raise ReplayError(f"num_layers must be >= 1, got {num_layers}")
        layers = tuple(_int_id(i, "trace layer id") for i in trace_layers)
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.num_layers for i in layers):
            raise ReplayError(f"{kind} trace layers must be distinct increasing ids in "
                              f"[0, {self.num_layers}), got {layers}")
        self.kind = kind
        self.trace_layers = layers
        self._column = {layer: c for c, layer in enumerate(layers)}
        self._registered: set[int] = set()  # every registered id, streams or not
        self._streams: set[int] = set()     # registered ids that have a column

    @classmethod
    def for_routing(cls, config: Any) -> "ReplayRegistry":
        """Registry over ``config.moe_layers`` (a :class:`rollout.model.config.ModelConfig`)."""
        return cls(config.moe_layers, config.num_hidden_layers, kind="routing")

    @classmethod
    def for_indexer(cls, config: Any) -> "ReplayRegistry":
        """Registry over ``config.indexed_layers`` (a :class:`rollout.model.config.ModelConfig`)."""
        return cls(config.indexed_layers, config.num_hidden_layers, kind="indexer")

    def register(self, global_layer_ids: Iterable[int]) -> tuple[int, ...]:
        """Register local layers by global id; return the ones that have a stream, sorted.

        Ids without a trace column (dense layers for routing, layers without an indexer) are
        registered as having no stream: they replay nothing.

        Raises:
            ReplayError: an id outside ``[0, num_layers)`` or registered twice (two modules
                claiming one layer).
        """
        ids = [_int_id(i, "layer id") for i in global_layer_ids]
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ReplayError(f"{self.kind} replay: layer ids {bad} outside [0, {self.num_layers})")
        again = sorted({i for i in ids if i in self._registered or ids.count(i) > 1})
        if again:
            raise ReplayError(f"{self.kind} replay: layers {again} registered twice")
        self._registered.update(ids)
        new = sorted(i for i in ids if i in self._column)
        self._streams.update(new)
        return tuple(new)

    def register_stage(self, pp_rank: int, layers_per_stage: int) -> tuple[int, ...]:
        """Register pipeline stage ``pp_rank``'s layers ``[pp_rank * n, (pp_rank + 1) * n)``.

        For uneven or interleaved (VPP) stages, pass the explicit list to :meth:`register`.

        Raises:
            ReplayError: a negative rank, ``layers_per_stage < 1``, or a stage past the last layer.
        """
        rank, n = _int_id(pp_rank, "pp_rank"), _int_id(layers_per_stage, "layers_per_stage")
        if rank < 0 or n < 1 or (rank + 1) * n > self.num_layers:
            raise ReplayError(f"pipeline stage {rank} of {n} layers does not fit {self.num_layers} layers")
        return self.register(range(rank * n, (rank + 1) * n))

    @property
    def layers(self) -> tuple[int, ...]:
        """Registered global layer ids that have a stream, increasing (= local trace order)."""
        return tuple(sorted(self._streams))

    def column(self, layer_id: int) -> int:
        """Column of global layer ``layer_id`` in the full trace.

        Raises:
            ReplayError: the layer has no column (dense / no indexer) or is not registered here.
        """
        layer = _int_id(layer_id, "layer id")
        if layer not in self._column:
            raise ReplayError(f"{self.kind} replay: layer {layer} has no trace column "
                              f"(trace layers {self.trace_layers})")
        if layer not in self._streams:
            raise ReplayError(f"{self.kind} replay: layer {layer} is not registered on this part "
                              f"(registered {self.layers})")
        return self._column[layer]

    def _check_full(self, trace: Any) -> None:
        if not isinstance(trace, (np.ndarray, torch.Tensor)) or trace.ndim < 2 \
                or trace.shape[-2] != len(self.trace_layers):
            raise ReplayError(
                f"{self.kind} trace must be [..., {len(self.trace_layers)}, K] (one column per layer "
                f"of {self.trace_layers}), got {getattr(trace, 'shape', type(trace).__name__)}")

    def stream(self, trace: Any, layer_id: int) -> Any:
        """The replay stream ``[..., K]`` of global layer ``layer_id`` from the full trace (a view).

        Raises:
            ReplayError: wrong trace shape, or as :meth:`column`.
        """
        self._check_full(trace)
        return trace[..., self.column(layer_id), :]

    def local_trace(self, trace: Any) -> Any:
        """Columns of the registered layers, ``[..., len(layers), K]``, in :attr:`layers` order.

        Raises:
            ReplayError: wrong trace shape.
        """
        self._check_full(trace)
        cols = [self._column[i] for i in self.layers]
        if isinstance(trace, torch.Tensor):
            return trace.index_select(trace.ndim - 2, torch.tensor(cols, dtype=torch.long,
                                                                   device=trace.device))
        return np.take(trace, cols, axis=trace.ndim - 2)


# --------------------------------------------------------------------------- SP, -1 rows


def sp_slice(indices: Any, sp_rank: int, sp_size: int, dim: int = 0) -> Any:
    """This SP rank's rows of a replayed trace: the split of ``torch.chunk(x, sp_size, dim)``.

    ``torch.chunk`` gives chunks of ``ceil(T / sp_size)`` rows, the last one shorter; rank
    ``r`` gets rows ``[r * c, min((r + 1) * c, T))``, exactly the token rows of its activations.

    Args:
        indices: numpy array or torch tensor with the token axis at ``dim``.
        sp_rank, sp_size: ``0 <= sp_rank < sp_size``.

    Returns:
        a view (numpy / torch slice) of the rank's rows.

    Raises:
        ReplayError: bad rank / size, or a rank for which ``torch.chunk`` yields no chunk
            (``T`` too small: that rank holds no activations either).
    """
    size, rank = _int_id(sp_size, "sp_size"), _int_id(sp_rank, "sp_rank")
    if size < 1 or not 0 <= rank < size:
        raise ReplayError(f"SP rank must lie in [0, sp_size={size}), got {rank}")
    if not isinstance(indices, (np.ndarray, torch.Tensor)) or indices.ndim == 0:
        raise ReplayError(f"indices must be an array with a token axis, got {type(indices).__name__}")
    t = indices.shape[dim]
    chunk = -(-t // size)
    start = rank * chunk
    if start >= t and not (t == 0 and rank == 0):
        raise ReplayError(f"torch.chunk of {t} rows into {size} gives no chunk for SP rank {rank}")
    sl = [slice(None)] * indices.ndim
    sl[dim] = slice(start, min(start + chunk, t))
    return indices[tuple(sl)]


def replayed_rows(trace: Any) -> Any:
    """Bool ``[...]`` (the trace shape without ``K``): True where the row replays something.

    A row of only ``-1`` is "no replay: use the layer's own choice".
    """
    if isinstance(trace, torch.Tensor):
        return (trace >= 0).any(-1)
    return (_as_numpy(trace, "trace") >= 0).any(-1)


def fill_own_choice(replay: Any, own: Any, *, allow_partial_rows: bool = False) -> Any:
    """``replay`` with every all ``-1`` row replaced by the layer's own choice ``own``.

    Args:
        replay: int ``[..., K]`` replayed indices (numpy or torch), ``-1`` = empty slot.
        own: int of the same shape, what the router / indexer chooses itself.
        allow_partial_rows: allow rows mixing indices and ``-1`` (indexer rows: a query with
            fewer than ``K`` causal keys); routing rows must be all experts or all ``-1``.

    Returns:
        same type, shape and dtype as ``replay``.

    Raises:
        ReplayError: shapes differ, or a partial row when ``allow_partial_rows`` is False.
    """
    if tuple(replay.shape) != tuple(own.shape):
        raise ReplayError(f"replay {tuple(replay.shape)} and own {tuple(own.shape)} differ in shape")
    valid = replay >= 0
    if not allow_partial_rows:
        partial = valid.any(-1) & ~valid.all(-1)
        if bool(partial.any()):
            raise ReplayError(f"replay rows mix indices and -1 at {int(partial.sum())} rows, e.g. "
                              f"{replay[partial][0].tolist()}")
    empty = ~valid.any(-1, keepdims=True) if isinstance(replay, np.ndarray) else ~valid.any(-1, keepdim=True)
    if isinstance(replay, torch.Tensor):
        return torch.where(empty, own.to(replay.dtype), replay)
    return np.where(empty, np.asarray(own, dtype=replay.dtype), replay)


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
    for t, l in zip(*np.nonzero(differ)):
        if len(listed) == max_listed:
            break
        listed.append(Mismatch(int(t), ids[l], tuple(sorted(set(u[t, l][u[t, l] >= 0].tolist()))),
                               tuple(sorted(set(o[t, l][o[t, l] >= 0].tolist())))))
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
    inter, n_u, n_o = _set_overlap(u, o)
    differ = (inter != n_u) | (inter != n_o)
    return float((differ & valid).sum() / n)


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
