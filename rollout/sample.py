"""The trajectory contract between rollout and trainer (the only rollout module trainer imports).

A :class:`Sample` is one trajectory of a prompt group. It is immutable: its arrays are
read-only numpy arrays, checked once at construction, so every later stage can trust the
alignment instead of re-validating or copying. Shapes (docs/design.md#sample-contract):

==================  ======================  ==============================================
field               dtype / shape           meaning
==================  ======================  ==============================================
prompt_ids          int32 [P]               prompt tokens
response_ids        int32 [R]               generated (and observation) tokens
loss_mask           uint8 [R]               1 = trained on, 0 = observation / tool token
rollout_logprobs    float32 [R]             behaviour logprob of each token under the
                                            engine's processed distribution; finite where
                                            loss_mask is 1
sample_support      int32 [R, 1+W] | None   col 0 sampled id, cols 1.. support, -1 excluded
routed_experts      int32 [P+R-1, L, K]     MoE experts the engine picked (R3)
indexer_topk        int32 [P+R-1, L, K_idx] sparse-attention keys the engine picked, -1 none
synthetic_eos       bool                    the last token is an EOS the engine never sampled
==================  ======================  ==============================================

Derived, not a field: :attr:`Sample.sampled_mask`, the loss tokens the engine sampled, i.e. the
rows whose ``rollout_logprobs`` is a behaviour logprob (docs/design.md#trace-arrays).
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

STATUSES = ("completed", "truncated", "aborted")
TRACE_FIELDS = ("sample_support", "routed_experts", "indexer_topk")


class SampleError(ValueError):
    """A trajectory violates the contract; the message names the sample and the field."""

    def __init__(self, sample_id: Any, field_name: str, problem: str) -> None:
        self.sample_id = sample_id
        self.field = field_name
        super().__init__(f"sample {sample_id}: field {field_name!r}: {problem}")


def required_traces(model_config: Any, *, support_replay: bool, routing_replay: bool,
                    indexer_replay: bool) -> tuple[str, ...]:
    """The trace fields every trajectory of a run must carry, in ``TRACE_FIELDS`` order.

    A trace is required exactly when the trainer replays it and the model has something to
    replay: ``sample_support`` with support replay on; ``routed_experts`` with R3 on and at least
    one MoE layer; ``indexer_topk`` with indexer replay on and at least one indexed layer. The
    launcher asks the engines to capture exactly these, the rollout side assembles every
    trajectory with them required (``replayrl.rollout.trajectory.merge_turns``) and the trainer refuses
    a batch lacking one (:func:`check_required_traces`), so a trajectory lacking one is an
    error, never a sample trained without its replay.

    Args:
        model_config: the policy's shape: anything with ``moe_layers`` and
            ``indexed_layers`` (a ``replayrl.rollout.model.config.ModelConfig``).
        support_replay, routing_replay, indexer_replay: the trainer's replay switches
            (``--use-support-replay``, ``--use-routing-replay``, ``--use-indexer-replay``).

    Returns:
        A tuple of trace field names (a subset of ``replayrl.rollout.sample.TRACE_FIELDS``).
    """
    on = {"sample_support": support_replay,
          "routed_experts": routing_replay and len(model_config.moe_layers) > 0,
          "indexer_topk": indexer_replay and len(model_config.indexed_layers) > 0}
    return tuple(name for name in TRACE_FIELDS if on[name])


REPLAY_FLAGS = {"sample_support": "--use-support-replay", "routed_experts": "--use-routing-replay",
                "indexer_topk": "--use-indexer-replay"}
"""trace field -> the flag of the replay that needs it (for messages)."""


class MissingTraceError(SampleError):
    """A trace an enabled replay needs is absent from a sample (names the sample and the field)."""


def check_required_traces(samples: Any, required: Any) -> None:
    """Refuse samples that lack a trace the run replays.

    Args:
        samples: iterable of :class:`Sample`.
        required: trace field names (:func:`required_traces`).
    Raises:
        MissingTraceError: the first sample (in order) lacking a required field, naming the
            sample, the field and the replay flag that needs it. Nothing is trained with the
            model's own choices in place of a missing trace.
    """
    for s in samples:
        for name in required:
            if getattr(s, name) is None:
                raise MissingTraceError(s.sample_id, name, f"absent, but {REPLAY_FLAGS[name]} "
                                        f"is on and the model has layers to replay it; the "
                                        f"engine must capture it")


def _frozen_array(sample_id: Any, name: str, value: Any, dtype: np.dtype, ndim: int) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as exc:  # e.g. ragged nested lists
        raise SampleError(sample_id, name, f"not an array: {exc}") from None
    if arr.ndim != ndim:
        raise SampleError(sample_id, name, f"expected {ndim}-d, got shape {arr.shape}")
    if arr.dtype != dtype:
        if arr.size and not np.can_cast(arr.dtype, dtype, casting="same_kind"):
            raise SampleError(sample_id, name, f"dtype {arr.dtype} cannot become {dtype}")
        arr = arr.astype(dtype)
    elif arr.flags.writeable:
        arr = arr.copy()  # the caller keeps no handle that could mutate a frozen sample
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class Sample:
    """One trajectory; see the module docstring for every field's dtype and shape.

    Raises:
        SampleError: at construction, naming the sample and field, when a dtype, rank or length
            disagrees with the contract, a loss-bearing logprob is not finite, or ``status`` is
            unknown.
    """

    sample_id: int
    group_id: int
    rollout_id: int
    policy_version: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    reward: float = 0.0
    status: str = "completed"
    sample_support: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    indexer_topk: np.ndarray | None = None
    synthetic_eos: bool = False

    def __post_init__(self) -> None:
        sid = self.sample_id
        put = object.__setattr__
        put(self, "prompt_ids", _frozen_array(sid, "prompt_ids", self.prompt_ids, np.int32, 1))
        put(self, "response_ids", _frozen_array(sid, "response_ids", self.response_ids, np.int32, 1))
        put(self, "loss_mask", _frozen_array(sid, "loss_mask", self.loss_mask, np.uint8, 1))
        put(self, "rollout_logprobs",
            _frozen_array(sid, "rollout_logprobs", self.rollout_logprobs, np.float32, 1))
        P, R = len(self.prompt_ids), len(self.response_ids)
        if P == 0:
            raise SampleError(sid, "prompt_ids", "empty prompt")
        for name in ("loss_mask", "rollout_logprobs"):
            if len(getattr(self, name)) != R:
                raise SampleError(sid, name, f"length {len(getattr(self, name))} != "
                                             f"len(response_ids) {R}")
        if np.any(self.loss_mask > 1):
            raise SampleError(sid, "loss_mask", "values must be 0 or 1")
        bad = (self.loss_mask == 1) & ~np.isfinite(self.rollout_logprobs)
        if bad.any():
            raise SampleError(sid, "rollout_logprobs",
                              f"non-finite at loss-bearing positions {np.flatnonzero(bad)[:8].tolist()}")
        if self.status not in STATUSES:
            raise SampleError(sid, "status", f"{self.status!r} not in {STATUSES}")
        if not math.isfinite(float(self.reward)):
            raise SampleError(sid, "reward", f"not finite: {self.reward}")
        put(self, "reward", float(self.reward))
        expected_rows = {"sample_support": R, "routed_experts": P + R - 1, "indexer_topk": P + R - 1}
        ranks = {"sample_support": 2, "routed_experts": 3, "indexer_topk": 3}
        for name in TRACE_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            arr = _frozen_array(sid, name, value, np.int32, ranks[name])
            if arr.shape[0] != expected_rows[name]:
                raise SampleError(sid, name, f"{arr.shape[0]} rows, expected {expected_rows[name]} "
                                             f"(P={P}, R={R})")
            put(self, name, arr)
        if self.synthetic_eos and R == 0:
            raise SampleError(sid, "synthetic_eos", "set on an empty response")
        if self.sample_support is not None:
            self._check_unsupported_rows()

    def _check_unsupported_rows(self) -> None:
        # A loss-bearing row without captured candidates can only be the one synthetic EOS
        # appended last: its logprob then uses the full-vocabulary fallback. Any other such row
        # would silently train on a distribution the engine never sampled from.
        sid, support = self.sample_id, self.sample_support
        unsupported = np.flatnonzero((self.loss_mask == 1) & (support[:, 1:] == -1).all(axis=1))
        if len(unsupported) > 1:
            raise SampleError(sid, "sample_support",
                              f"{len(unsupported)} loss-bearing rows without support "
                              f"{unsupported[:8].tolist()}: at most one synthetic EOS per trajectory")
        if self.synthetic_eos and (support[-1, 1:] != -1).any():
            raise SampleError(sid, "sample_support", "synthetic EOS row must have no captured candidates")
        if len(unsupported) == 1 and not (self.synthetic_eos and unsupported[0] == len(support) - 1):
            raise SampleError(sid, "sample_support",
                              f"row {unsupported[0]} is loss-bearing without support and is not a "
                              f"synthetic EOS in the last row")

    @property
    def sampled_mask(self) -> np.ndarray:
        """uint8 [R], read-only: 1 where the token is loss-bearing AND the engine sampled it.

        This is the one definition of "tokens with a behaviour logprob": ``loss_mask`` with the
        synthetic EOS row (the last row when ``synthetic_eos`` is set; the contract guarantees
        it is the one loss-bearing row without captured support) set to 0. Observation rows
        are 0 already (``loss_mask`` 0). Everything that reads ``rollout_logprobs`` -- RS gates
        (token / sequence / geometric, sums and token count), TIS weights, the exact-refill
        admission, the |rollout - trainer logprob| metrics -- reads it under this mask; the
        synthetic row's placeholder (``replayrl.rollout.trajectory.SYNTHETIC_EOS_LOGPROB``) is never a
        behaviour logprob (docs/design.md#trainer-math, docs/design.md#rejection-sampling). Equal to
        ``loss_mask`` when ``synthetic_eos`` is False.
        """
        mask = np.array(self.loss_mask)
        if self.synthetic_eos:
            mask[-1] = 0
        mask.flags.writeable = False
        return mask

    @property
    def total_length(self) -> int:
        """``P + R`` tokens."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def tokens(self) -> np.ndarray:
        """int32 [P+R]: prompt then response."""
        return np.concatenate([self.prompt_ids, self.response_ids])

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of fields (arrays shared, not copied) for the transport codec."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Sample":
        """Rebuild from :meth:`to_dict` output (e.g. a decoded message).

        Raises:
            SampleError: a field is missing or unknown, or the contract is violated.
        """
        sid = data.get("sample_id", "?") if isinstance(data, Mapping) else "?"
        if not isinstance(data, Mapping):
            raise SampleError(sid, "<message>", f"expected a mapping, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise SampleError(sid, sorted(unknown)[0], "unknown field")
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = required - set(data)
        if missing:
            raise SampleError(sid, sorted(missing)[0], "missing")
        return cls(**data)


# -- a batch of samples on the wire -----------------------------------------------------------
_SCALARS = {"sample_id": np.int64, "group_id": np.int64, "rollout_id": np.int64,
            "policy_version": np.int64, "reward": np.float64, "synthetic_eos": np.bool_}
_PER_TOKEN = {"response_ids": np.int32, "loss_mask": np.uint8, "rollout_logprobs": np.float32}


def pack_rows(values: Sequence[np.ndarray | None]) -> np.ndarray | list | None:
    """One column of a batch from each item's optional array (rows along axis 0).

    Returns ``None`` when no item has one; the items' rows concatenated in order when every
    item has one with the same trailing shape; otherwise ``values`` as a list (one entry per
    item). Inverse: :func:`unpack_rows`. Used by :func:`samples_to_columns` and
    ``replayrl.rollout.engines.base.generations_to_columns``.
    """
    if all(v is None for v in values):
        return None
    if all(v is not None for v in values) and len({v.shape[1:] for v in values}) == 1:
        return np.concatenate(values)
    return list(values)


def unpack_rows(value: Any, counts: Sequence[int]) -> list:
    """Each item's rows of a :func:`pack_rows` column: views for a concatenated array, the
    entries of a list, ``None`` for every item of a ``None`` column.

    Args:
        counts: rows per item (non-negative ints), one per item.
    Raises:
        ValueError: a list of another length, or an array whose row count is not
            ``sum(counts)`` (the message says which; callers name the column).
    """
    n = len(counts)
    if value is None:
        return [None] * n
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{len(value)} entries for {n} samples")
        return value
    ends = np.cumsum(counts, dtype=np.int64).tolist()
    total = ends[-1] if ends else 0
    if not isinstance(value, np.ndarray) or value.ndim < 1 or len(value) != total:
        raise ValueError(f"{getattr(value, 'shape', type(value).__name__)} does not hold the "
                         f"{total} rows the lengths give")
    # slicing, not np.split: ~10x less per item
    return [value[start:end] for start, end in zip([0, *ends[:-1]], ends)]


def samples_to_columns(samples: Sequence[Sample]) -> dict[str, Any]:
    """A batch of samples as one array per field, for the transport codec.

    A batch of ``N`` samples crosses the wire as about fifteen arrays instead of seven per
    sample (896 for the default 128-sample batch): the per-array cost of encoding, sending and
    decoding dominated the batch's transfer. Layout (``P_i`` / ``R_i`` the prompt / response
    lengths; ragged fields are concatenated in sample order):

    - ``sample_id``, ``group_id``, ``rollout_id``, ``policy_version`` int64 ``[N]``, ``reward``
      float64 ``[N]``, ``synthetic_eos`` bool ``[N]``, ``status`` list of ``N`` str;
    - ``prompt_lengths``, ``response_lengths`` int64 ``[N]``;
    - ``prompt_ids`` int32 ``[sum P]``; ``response_ids`` int32, ``loss_mask`` uint8,
      ``rollout_logprobs`` float32, each ``[sum R]``;
    - each trace of ``TRACE_FIELDS``: ``None`` when no sample has it; the samples' rows
      concatenated (``[sum R, 1+W]`` for the support, ``[sum (P+R-1), L, K]`` for routing and
      indexer) when every sample has it with the same trailing shape; otherwise a list of
      ``N`` per-sample arrays or ``None``.

    Arrays are new (concatenated) arrays; the samples are not changed. Inverse:
    :func:`samples_from_columns`.
    """
    cols: dict[str, Any] = {name: np.array([getattr(s, name) for s in samples], dtype=dtype)
                            for name, dtype in _SCALARS.items()}
    cols["status"] = [s.status for s in samples]
    cols["prompt_lengths"] = np.array([len(s.prompt_ids) for s in samples], dtype=np.int64)
    cols["response_lengths"] = np.array([len(s.response_ids) for s in samples], dtype=np.int64)
    for name, dtype in {"prompt_ids": np.int32, **_PER_TOKEN}.items():
        cols[name] = (np.concatenate([getattr(s, name) for s in samples]) if samples
                      else np.zeros(0, dtype))
    for name in TRACE_FIELDS:
        cols[name] = pack_rows([getattr(s, name) for s in samples])
    return cols


def samples_from_columns(columns: Mapping[str, Any]) -> list[Sample]:
    """Rebuild the samples of :func:`samples_to_columns` (e.g. a decoded message).

    Each sample's arrays are views into the columns (no copy when the columns are read-only,
    as decoded messages are) and every sample is checked by :class:`Sample` as at any other
    construction.

    Raises:
        SampleError: a missing or unknown column, a column whose length disagrees with the
            lengths (named by the column; the sample is ``"batch"`` when no single sample is at
            fault), or a sample violating the contract (named by its ``sample_id``).
    """
    if not isinstance(columns, Mapping):
        raise SampleError("batch", "<message>", f"expected a mapping of columns, got "
                                                f"{type(columns).__name__}")
    names = {*_SCALARS, "status", "prompt_lengths", "response_lengths", "prompt_ids",
             *_PER_TOKEN, *TRACE_FIELDS}
    for problem, found in (("unknown column", set(columns) - names),
                           ("missing column", names - set(columns))):
        if found:
            raise SampleError("batch", sorted(found)[0], problem)
    lengths = {}
    for name in ("prompt_lengths", "response_lengths"):
        arr = np.asarray(columns[name])
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or (arr < 0).any():
            raise SampleError("batch", name, f"expected non-negative integers [N], got "
                                             f"{arr.dtype} {arr.shape}")
        lengths[name] = arr.astype(np.int64)
    P, R = lengths["prompt_lengths"], lengths["response_lengths"]
    n = len(P)
    if len(R) != n or len(columns["status"]) != n:
        raise SampleError("batch", "response_lengths" if len(R) != n else "status",
                          f"{len(R) if len(R) != n else len(columns['status'])} entries for "
                          f"{n} samples")
    scalars = {}
    for name in _SCALARS:
        arr = np.asarray(columns[name])
        if arr.shape != (n,):
            raise SampleError("batch", name, f"shape {arr.shape}, expected ({n},)")
        scalars[name] = arr.tolist()
    rows = {"prompt_ids": P, **{name: R for name in _PER_TOKEN},
            "sample_support": R, "routed_experts": np.maximum(P + R - 1, 0),
            "indexer_topk": np.maximum(P + R - 1, 0)}
    split = {}
    for name, counts in rows.items():
        try:
            split[name] = unpack_rows(columns[name], counts)
        except ValueError as exc:
            raise SampleError("batch", name, str(exc)) from None
    if _columns_keep_the_contract(columns, P, R, scalars):
        # every check Sample.__post_init__ makes already passed for the whole batch at once
        # (about 30 us per sample saved); the arrays are read-only views of the columns
        return [_checked_sample(**{name: scalars[name][i] for name in _SCALARS},
                                status=columns["status"][i],
                                **{name: split[name][i] for name in rows}) for i in range(n)]
    # a batch failing any of them is built sample by sample: the first violation raises the
    # error Sample names (sample and field), exactly as without columns
    return [Sample(**{name: scalars[name][i] for name in _SCALARS}, status=columns["status"][i],
                   **{name: split[name][i] for name in rows})
            for i in range(n)]


_COLUMN_RANKS = {"prompt_ids": (np.int32, 1), "response_ids": (np.int32, 1),
                 "loss_mask": (np.uint8, 1), "rollout_logprobs": (np.float32, 1),
                 "sample_support": (np.int32, 2), "routed_experts": (np.int32, 3),
                 "indexer_topk": (np.int32, 3)}


def _columns_keep_the_contract(columns: Mapping[str, Any], P: np.ndarray, R: np.ndarray,
                               scalars: dict[str, list]) -> bool:
    """True when every sample of the columns passes every check of ``Sample.__post_init__``
    (the same checks, made once per column instead of once per sample); False sends the batch
    through per-sample construction. Rows per sample already match the lengths (checked by
    the caller). tests/test_sample_columns.py checks both paths accept the same batches."""
    for name, (dtype, ndim) in _COLUMN_RANKS.items():
        value = columns[name]
        if value is None and name in TRACE_FIELDS:
            continue
        if (not isinstance(value, np.ndarray) or value.dtype != dtype or value.ndim != ndim
                or value.flags.writeable):  # a writable column would let the caller mutate samples
            return False
    n = len(P)
    if n == 0:
        return True
    loss, logp = columns["loss_mask"], columns["rollout_logprobs"]
    synthetic = np.asarray(scalars["synthetic_eos"], dtype=bool)
    if (P.min() < 1 or (loss > 1).any() or not np.isfinite(logp[loss == 1]).all()
            or not set(columns["status"]) <= set(STATUSES) or not all(isinstance(x, str) for x in columns["status"])
            or not np.isfinite(np.asarray(scalars["reward"], dtype=np.float64)).all()
            or (synthetic & (R == 0)).any()):
        return False
    support = columns["sample_support"]
    if support is not None:
        last = np.zeros(len(loss), dtype=bool)
        last[(np.cumsum(R) - 1)[R > 0]] = True
        owner = np.repeat(np.arange(n), R)
        no_candidates = (support[:, 1:] == -1).all(axis=1)
        unsupported = np.flatnonzero((loss == 1) & no_candidates)
        # only a synthetic EOS, in its sample's last row, may be loss-bearing without support,
        # and a synthetic EOS row has no candidates
        if not (last[unsupported] & synthetic[owner[unsupported]]).all():
            return False
        if not no_candidates[last & synthetic[owner]].all():
            return False
    return True


def _checked_sample(**fields: Any) -> Sample:
    """A Sample whose fields passed :func:`_columns_keep_the_contract` (no second check)."""
    sample = object.__new__(Sample)
    for name, value in fields.items():
        object.__setattr__(sample, name, value)
    return sample
