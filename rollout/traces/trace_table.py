"""The trace table: every per-token trace a trajectory can carry, described once.

A *trace* is an int array the engine records while generating and the trainer replays
(docs/design/traces.md#trace-arrays). Each row of :data:`TRACES` gives one trace's name, dtype,
per-token shape, row space, padding value and the setting that enables its replay; everything
that handles traces generically reads this table instead of naming them:

* :class:`replayrl.rollout.sample.Sample` -- its trace fields, their check and the column form;
* :class:`replayrl.rollout.engines.base.Generation` and its column form;
* :class:`replayrl.rollout.traces.trajectory.MergedTrajectory`, ``truncate``, ``append_synthetic_eos``;
* :class:`replayrl.trainer.batching.batch.TrainBatch` and ``collate`` (padding);
* the trainer's flip / drift rates (``replayrl.trainer.ranks.rank_step``).

Adding a trace is one row here plus the capture code (an engine filling the field) and the
replay code (the model or loss reading it). Row spaces (docs/design/sample-contract.md#sample-contract),
for a trajectory of ``P`` prompt and ``R`` response tokens:

* ``"response"``: ``R`` rows, one per response token;
* ``"position"``: ``P + R - 1`` rows, one per forwarded position (the last token is never
  forwarded).

The trainer reads this module through :mod:`replayrl.rollout.sample`'s layer rule exception
(tests/unit/test_layering.py ``TRAINER_MAY_USE``): it is part of the rollout -> trainer contract.
Consumers look the table up as ``trace_table.TRACES`` at call time (never ``from ... import
TRACES``), so a test may monkeypatch it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["TraceSpec", "TRACES", "spec", "trace_fields", "rows_in", "model_shape"]


@dataclass(frozen=True)
class TraceSpec:
    """One trace.

    Attributes:
        name: the field name on Sample, Generation, MergedTrajectory and in the column form.
        dtype: numpy dtype of the stored array (int32 for every trace today).
        shape: names of the per-token dimensions after the row axis (``W`` support width,
            ``L_moe`` / ``L_idx`` MoE / indexed layers, ``K`` router top-k, ``K_idx`` indexer
            top-k); the array is ``[rows, *shape]``, so its rank is ``1 + len(shape)``.
        rows: row space, ``"response"`` (``R`` rows) or ``"position"`` (``P + R - 1`` rows).
        pad: value of a row nobody captured (observation tokens, a synthetic EOS, batch
            padding): ``-1`` = "nothing here", which the model reads as "no replay".
        replay: short name of the replay: the keyword of ``required_traces`` is
            ``f"{replay}_replay"``, the keyword of ``replayrl.trainer.batching.batch.collate`` is ``replay``, the
            flip / drift metrics are ``f"{replay}_flip_rate"`` / ``f"{replay}_drift_rate"``.
        flag: the command-line switch enabling the replay (named in error messages).
        setting: the ``TrainerConfig`` attribute of that switch.
        layers: the model-config attribute listing the layers the trace covers; the trace is
            required only when it is non-empty. ``None``: not tied to layers (always required
            when its replay is on).
        batch_field: the ``TrainBatch`` field carrying it to the trainer's forward.
        key_slots: values are key positions inside the trajectory (packing shifts them).
        flip_rates: the trainer's forward reports the choices it used and its own
            (``out.<name>``, ``out.own_<name>``); they are compared with the engine's as the
            metrics ``<replay>_flip_rate`` / ``<replay>_drift_rate``, and the trace travels to
            the forward whenever captured, replayed or not. False: it travels only when its
            replay is on.
        width: the model-config attribute giving the trace's last dimension (the top-k:
            ``num_experts_per_tok``, ``index_topk``); with :attr:`layers` it makes the
            per-token shape the model expects (:func:`model_shape`). ``None``: the width is
            not the model's (the support width is the sampler's).
        storage: how the column form (what crosses the wire) stores the trace
            (:mod:`replayrl.rollout.traces.trace_storage`): ``"raw"`` as it is, ``"ids"`` in the
            smallest unsigned dtype holding its values (expert ids: uint8 up to 256 experts),
            ``"sets"`` each row as the set of key positions its query may see (``key_slots``
            traces: row ``p`` of a trajectory sees keys ``0..p``).
    """

    name: str
    dtype: type
    shape: tuple[str, ...]
    rows: Literal["response", "position"]
    pad: int
    replay: str
    flag: str
    setting: str
    layers: str | None
    batch_field: str
    key_slots: bool = False
    flip_rates: bool = False
    width: str | None = None
    storage: Literal["raw", "ids", "sets"] = "raw"

    @property
    def ndim(self) -> int:
        """Rank of the stored array: the row axis plus :attr:`shape`."""
        return 1 + len(self.shape)


TRACES: tuple[TraceSpec, ...] = (
    TraceSpec("sample_support", np.int32, ("1+W",), "response", -1, "support",
              "--use-support-replay", "use_support_replay", None, "support"),
    TraceSpec("routed_experts", np.int32, ("L_moe", "K"), "position", -1, "routing",
              "--use-routing-replay", "use_routing_replay", "moe_layers", "routed_experts",
              flip_rates=True, width="num_experts_per_tok", storage="ids"),
    TraceSpec("indexer_topk", np.int32, ("L_idx", "K_idx"), "position", -1,
              "indexer", "--use-indexer-replay", "use_indexer_replay", "indexed_layers",
              "indexer_topk", key_slots=True, flip_rates=True, width="index_topk", storage="sets"),
)
"""Every trace, in canonical order (the order of ``TRACE_FIELDS`` and of the dataclass fields)."""


def spec(name: str) -> TraceSpec:
    """The row of trace ``name``.

    Raises:
        KeyError: ``name`` is no trace (the message lists the known ones).
    """
    for row in TRACES:
        if row.name == name:
            return row
    raise KeyError(f"unknown trace {name!r}; known: {tuple(r.name for r in TRACES)}")


def rows_in(row: TraceSpec, P: Any, R: Any) -> Any:
    """Rows of trace ``row`` for prompt length ``P`` and response length ``R`` (ints or int
    arrays): ``R`` for response rows, ``P + R - 1`` (never below 0) for position rows."""
    return R if row.rows == "response" else np.maximum(P + R - 1, 0)


def model_shape(row: TraceSpec, model_config: Any) -> tuple[int, int] | None:
    """The per-token shape ``(layers, top-k)`` the model gives trace ``row``: the number of
    ``row.layers`` (e.g. ``len(moe_layers)``) and the value of ``row.width`` (e.g.
    ``num_experts_per_tok``) of ``model_config`` (a ``replayrl.rollout.model.config.ModelConfig``);
    ``None`` for a trace whose shape is not the model's (``layers`` or ``width`` unset)."""
    if row.layers is None or row.width is None:
        return None
    return len(getattr(model_config, row.layers)), int(getattr(model_config, row.width))


def trace_fields(*, before: str | None = None, optional: bool = True, attr: str = "name"):
    """Class decorator adding one ``np.ndarray | None`` field per trace, to be applied BELOW
    ``@dataclass`` (it edits the class annotations the dataclass then reads).

    Args:
        before: insert the fields before this annotated field (keeps the field order callers
            see); ``None`` appends them.
        optional: give each field the default ``None`` (keyword-only when ``before`` has no
            default, so required fields may follow).
        attr: the :class:`TraceSpec` attribute naming the field (``"name"``, or
            ``"batch_field"`` for the trainer batch).
    """
    def add(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        names = [getattr(row, attr) for row in TRACES]
        out: dict[str, Any] = {}
        for key, value in own.items():
            if key == before:
                out.update({n: "np.ndarray | None" for n in names})
            out[key] = value
        if before is None:
            out.update({n: "np.ndarray | None" for n in names})
        cls.__annotations__ = out
        if optional:
            for n in names:
                setattr(cls, n, dataclasses.field(default=None, kw_only=True))
        return cls
    return add
