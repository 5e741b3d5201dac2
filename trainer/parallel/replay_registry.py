"""Replay of routing (R3) and indexer traces on a split model: PP layer registry, SP slicing.

The engine captures, per forwarded position, the experts every MoE router used and the keys
every sparse-attention indexer kept: traces ``[T, L, K]`` whose layer axis follows
``config.moe_layers`` / ``config.indexed_layers`` (global layer ids in increasing order; dense
layers have no column). The embedded trainer replays the whole trace on one rank
(``rollout/model/qwen3_moe.py``); this module keeps the replay correct when the model is split:

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
  synthetic EOS, padding; :func:`replayrl.trainer.replay.checks.replayed_rows` finds them).
  :func:`fill_own_choice` substitutes the own choice for a backend whose router cannot take
  ``-1`` (gathering router probabilities at ``-1`` or masking every key of an attention row
  would give NaN gradients).

The live checks of a replayed forward (:func:`replayrl.trainer.replay.checks.check_replay`, the flip rates)
stay in :mod:`replayrl.trainer.replay.checks`.

Source: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers" (R3), as implemented in slime / Megatron-LM routing replay; docs/design/traces.md#trace-arrays.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import torch

from replayrl.trainer.errors import ReplayError
from replayrl.trainer.replay.checks import _int_id

__all__ = ["ReplayRegistry", "sp_slice", "fill_own_choice"]


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
        """Registry over ``config.moe_layers`` (a :class:`replayrl.rollout.model.config.ModelConfig`)."""
        return cls(config.moe_layers, config.num_hidden_layers, kind="routing")

    @classmethod
    def for_indexer(cls, config: Any) -> "ReplayRegistry":
        """Registry over ``config.indexed_layers`` (a :class:`replayrl.rollout.model.config.ModelConfig`)."""
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
