"""The trajectory contract between rollout and trainer (the only rollout module trainer imports).

A :class:`Sample` is one trajectory of a prompt group. It is immutable: its arrays are
read-only numpy arrays, checked once at construction, so every later stage can trust the
alignment instead of re-validating or copying. Shapes (docs/design/sample-contract.md#sample-contract):

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

The three traces are the rows of ``replayrl.rollout.traces.trace_table.TRACES`` (name, dtype, per-token
shape, row space, padding, replay flag); :class:`Sample` gets one field per row from there.

Derived, not a field: :attr:`Sample.sampled_mask`, the loss tokens the engine sampled, i.e. the
rows whose ``rollout_logprobs`` is a behaviour logprob (docs/design/traces.md#trace-arrays).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

from replayrl.rollout.errors import MissingTraceError, SampleError, TraceShapeError
from replayrl.rollout.traces import trace_storage, trace_table
from replayrl.rollout.traces.trace_table import trace_fields

STATUSES = ("completed", "truncated", "aborted")
TRACE_FIELDS = tuple(row.name for row in trace_table.TRACES)
"""Every trace field name, in table order (read once at import; code that must follow a patched
table reads ``trace_table.TRACES`` itself)."""


def required_traces(model_config: Any, **replays: bool) -> tuple[str, ...]:
    """The trace fields every trajectory of a run must carry, in table order.

    A trace is required exactly when the trainer replays it and the model has something to
    replay: its replay is on and, for a trace tied to layers (``TraceSpec.layers``, e.g.
    ``moe_layers`` for ``routed_experts``), the model has at least one such layer. The
    launcher asks the engines to capture exactly these, the rollout side assembles every
    trajectory with them required (``replayrl.rollout.traces.trajectory.merge_turns``) and the trainer refuses
    a batch lacking one (:func:`check_required_traces`), so a trajectory lacking one is an
    error, never a sample trained without its replay.

    Args:
        model_config: the policy's shape: anything with the table's ``layers`` attributes
            (``moe_layers``, ``indexed_layers``: a ``replayrl.rollout.model.config.ModelConfig``).
        replays: ``<replay>_replay=bool`` per table row (``support_replay``, ``routing_replay``,
            ``indexer_replay``: the trainer's ``--use-support-replay`` ... switches); a row
            without its keyword counts as off.

    Returns:
        A tuple of trace field names (a subset of ``replayrl.rollout.sample.TRACE_FIELDS``).

    Raises:
        TypeError: a keyword that names no table row's replay.
    """
    rows = trace_table.TRACES
    unknown = sorted(set(replays) - {f"{row.replay}_replay" for row in rows})
    if unknown:
        raise TypeError(f"required_traces: unknown keyword {unknown[0]!r}")
    return tuple(row.name for row in rows
                 if replays.get(f"{row.replay}_replay", False)
                 and (row.layers is None or len(getattr(model_config, row.layers)) > 0))


def replay_flag(name: str) -> str:
    """The command-line switch of the replay that needs trace ``name`` (for messages)."""
    return trace_table.spec(name).flag


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
                raise MissingTraceError(s.sample_id, name, f"absent, but {replay_flag(name)} "
                                        f"is on and the model has layers to replay it; the "
                                        f"engine must capture it")


def check_trace_shapes(samples: Any, model_config: Any) -> None:
    """Refuse samples whose traces do not have the model's per-token shape.

    The one check of a trace's shape against the model, for every trace of
    ``trace_table.TRACES`` tied to the model (:func:`replayrl.rollout.traces.trace_table.model_shape`:
    ``routed_experts`` ``[rows, len(moe_layers), num_experts_per_tok]``, ``indexer_topk``
    ``[rows, len(indexed_layers), index_topk]``), whether its replay is on or off (a trace
    travels to the forward for the flip rates either way). A sample without the trace is not
    checked here (:func:`check_required_traces`).

    Args:
        samples: iterable of :class:`Sample`.
        model_config: the policy's shape (a ``replayrl.rollout.model.config.ModelConfig``).
    Raises:
        TraceShapeError: the first sample (in order) with a trace of another per-token shape
            (more or fewer layer columns, another top-k width), naming the sample, the field,
            its shape and the model's.
    """
    shapes = [(row, trace_table.model_shape(row, model_config)) for row in trace_table.TRACES]
    shapes = [(row, want) for row, want in shapes if want is not None]
    for s in samples:
        for row, want in shapes:
            arr = getattr(s, row.name)
            if arr is not None and arr.shape[1:] != want:
                raise TraceShapeError(s.sample_id, row.name, (
                    f"per-token shape {tuple(arr.shape[1:])} (layer columns x top-k), but the "
                    f"model's is {want}: {want[0]} {row.layers}, {row.width} {want[1]}"))


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


_TOKEN_ARRAYS = {"prompt_ids": np.int32, "response_ids": np.int32, "loss_mask": np.uint8,
                 "rollout_logprobs": np.float32}
"""The non-trace arrays of a sample: name -> dtype (each 1-d)."""


def check_contract(sample_ids: Sequence[Any], P: np.ndarray, R: np.ndarray, loss_mask: np.ndarray,
                   rollout_logprobs: np.ndarray, status: Sequence[Any], reward: Sequence[float],
                   synthetic_eos: np.ndarray, sample_support: np.ndarray | None) -> None:
    """The value checks of the sample contract, for ``N`` samples at once.

    The one check both :class:`Sample` (``N = 1``) and :func:`samples_from_columns` (a whole
    batch, then no per-sample check) make. Shapes and dtypes are already right: the arrays
    hold the samples' rows concatenated in order.

    Args:
        sample_ids: ``N`` ids (named in the error).
        P, R: int ``[N]`` prompt / response lengths.
        loss_mask: uint8 ``[sum R]``; rollout_logprobs: float32 ``[sum R]``.
        status: ``N`` statuses; reward: ``N`` floats; synthetic_eos: bool ``[N]``.
        sample_support: int32 ``[sum R, 1+W]`` or None.

    Raises:
        SampleError: for the first sample (in order) breaking a check, naming it and the field
            of its first broken check: an empty prompt (``prompt_ids``), a loss mask value
            other than 0 / 1, a non-finite logprob at a loss-bearing row, an unknown
            ``status``, a non-finite ``reward``, ``synthetic_eos`` on an empty response, or a
            loss-bearing row without support that is not the one synthetic EOS in the last
            row (``sample_support``).
    """
    n = len(P)
    if n == 0:
        return
    P, R = np.asarray(P, dtype=np.int64), np.asarray(R, dtype=np.int64)
    ends = np.cumsum(R)
    owner = np.repeat(np.arange(n), R) if n > 1 else np.zeros(len(loss_mask), dtype=np.intp)
    synthetic = np.asarray(synthetic_eos, dtype=bool)

    def per_sample(row_mask: np.ndarray) -> np.ndarray:  # bool [sum R] -> bool [N]
        if n == 1:  # one Sample's construction: the common case, half the time
            return np.array([row_mask.any()])
        return np.bincount(owner[row_mask], minlength=n) > 0

    loss_bearing = loss_mask == 1
    bad = {
        "prompt_ids": P < 1,
        "loss_mask": per_sample(loss_mask > 1),
        "rollout_logprobs": per_sample(loss_bearing & ~np.isfinite(rollout_logprobs)),
        "status": np.array([not (isinstance(x, str) and x in STATUSES) for x in status]),
        "reward": ~np.isfinite(np.asarray(reward, dtype=np.float64)),
        "synthetic_eos": synthetic & (R == 0),
    }
    if sample_support is not None:
        last = np.zeros(len(loss_mask), dtype=bool)
        last[(ends - 1)[R > 0]] = True
        eos_row = last & synthetic[owner]
        no_candidates = (sample_support[:, 1:] == -1).all(axis=1)
        # a loss-bearing row without captured candidates can only be the one synthetic EOS
        # appended last (its logprob uses the full-vocabulary fallback); any other such row
        # would silently train on a distribution the engine never sampled from. A synthetic
        # EOS row has no candidates.
        bad["sample_support"] = (per_sample(loss_bearing & no_candidates & ~eos_row)
                                 | per_sample(eos_row & ~no_candidates))
    failing = np.zeros(n, dtype=bool)
    for mask in bad.values():
        failing |= mask
    if not failing.any():
        return
    i = int(np.flatnonzero(failing)[0])
    field = next(name for name, mask in bad.items() if mask[i])
    rows = slice(int(ends[i] - R[i]), int(ends[i]))
    raise SampleError(sample_ids[i], field, _problem(
        field, loss=loss_mask[rows], logp=rollout_logprobs[rows], status=status[i],
        reward=reward[i], synthetic=bool(synthetic[i]),
        support=None if sample_support is None else sample_support[rows]))


def _problem(field: str, *, loss: np.ndarray, logp: np.ndarray, status: Any, reward: Any,
             synthetic: bool, support: np.ndarray | None) -> str:
    """The message of :func:`check_contract`'s broken check ``field``, from one sample's rows."""
    if field == "prompt_ids":
        return "empty prompt"
    if field == "loss_mask":
        return "values must be 0 or 1"
    if field == "rollout_logprobs":
        bad = (loss == 1) & ~np.isfinite(logp)
        return f"non-finite at loss-bearing positions {np.flatnonzero(bad)[:8].tolist()}"
    if field == "status":
        return f"{status!r} not in {STATUSES}"
    if field == "reward":
        return f"not finite: {reward}"
    if field == "synthetic_eos":
        return "set on an empty response"
    unsupported = np.flatnonzero((loss == 1) & (support[:, 1:] == -1).all(axis=1))
    if len(unsupported) > 1:
        return (f"{len(unsupported)} loss-bearing rows without support "
                f"{unsupported[:8].tolist()}: at most one synthetic EOS per trajectory")
    if synthetic and (support[-1, 1:] != -1).any():
        return "synthetic EOS row must have no captured candidates"
    return (f"row {unsupported[0]} is loss-bearing without support and is not a synthetic EOS "
            f"in the last row")


@dataclass(frozen=True, eq=False)
@trace_fields(before="synthetic_eos")
class Sample:
    """One trajectory; see the module docstring for every field's dtype and shape.

    Besides the fields below it has one field per trace of ``trace_table.TRACES``
    (``sample_support``, ``routed_experts``, ``indexer_topk``: ``np.ndarray | None``, default
    ``None``, keyword-only), placed before ``synthetic_eos``.

    Raises:
        SampleError: at construction, naming the sample and field, when an id or the policy
            version is not an int (a numpy integer becomes one; a float or bool is refused), a
            dtype, rank or length disagrees with the contract, a loss-bearing logprob is not
            finite, or ``status`` is unknown (:func:`check_contract`).
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
    synthetic_eos: bool = False

    def __post_init__(self) -> None:
        sid = self.sample_id
        put = object.__setattr__
        for name in _INT_SCALARS:
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise SampleError(sid, name, f"expected an int, got {type(value).__name__} {value!r}")
            put(self, name, int(value))
        for name, dtype in _TOKEN_ARRAYS.items():
            put(self, name, _frozen_array(sid, name, getattr(self, name), dtype, 1))
        P, R = len(self.prompt_ids), len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs"):
            if len(getattr(self, name)) != R:
                raise SampleError(sid, name, f"length {len(getattr(self, name))} != "
                                             f"len(response_ids) {R}")
        for row in trace_table.TRACES:
            value = getattr(self, row.name)
            if value is None:
                continue
            arr = _frozen_array(sid, row.name, value, row.dtype, row.ndim)
            expected = max(int(trace_table.rows_in(row, P, R)), 0)
            if arr.shape[0] != expected:
                raise SampleError(sid, row.name, f"{arr.shape[0]} rows, expected {expected} "
                                                 f"(P={P}, R={R})")
            put(self, row.name, arr)
        reward = self.reward
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise SampleError(sid, "reward", f"not a number: {reward!r}") from None
        check_contract([sid], np.array([P]), np.array([R]), self.loss_mask, self.rollout_logprobs,
                       [self.status], [reward], np.array([bool(self.synthetic_eos)]),
                       self.sample_support)
        put(self, "reward", reward)

    @property
    def sampled_mask(self) -> np.ndarray:
        """uint8 [R], read-only: 1 where the token is loss-bearing AND the engine sampled it.

        This is the one definition of "tokens with a behaviour logprob": ``loss_mask`` with the
        synthetic EOS row (the last row when ``synthetic_eos`` is set; the contract guarantees
        it is the one loss-bearing row without captured support) set to 0. Observation rows
        are 0 already (``loss_mask`` 0). Everything that reads ``rollout_logprobs`` -- RS gates
        (token / sequence / geometric, sums and token count), TIS weights, the exact-refill
        admission, the |rollout - trainer logprob| metrics -- reads it under this mask; the
        synthetic row's placeholder (``replayrl.rollout.traces.trajectory.SYNTHETIC_EOS_LOGPROB``) is never a
        behaviour logprob (docs/design/trainer-math.md#trainer-math,
        docs/design/rejection-sampling.md#rejection-sampling). Equal to ``loss_mask`` when
        ``synthetic_eos`` is False.
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
_INT_SCALARS = ("sample_id", "group_id", "rollout_id", "policy_version")
"""The identity and version fields: ints, never a float or bool that would compare equal."""


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


def samples_to_columns(samples: Sequence[Sample], *, compact: bool = True) -> dict[str, Any]:
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
    - each trace of ``trace_table.TRACES``: ``None`` when no sample has it; the samples' rows
      concatenated (``[sum R, ...]`` for response rows, e.g. the support, ``[sum (P+R-1), ...]``
      for position rows, e.g. routing and indexer) when every sample has it with the same
      trailing shape, stored as its table row's ``storage`` says
      (:func:`replayrl.rollout.traces.trace_storage.encode_column`: expert ids narrowed, indexer rows
      as key sets); otherwise a list of ``N`` per-sample arrays or ``None``. With
      ``compact=False`` every trace stays the plain int32 array (for a reader that is not
      :func:`samples_from_columns`, e.g. the REPL's ``sample()``).

    Arrays are new (concatenated) arrays; the samples are not changed. Inverse:
    :func:`samples_from_columns`.
    """
    cols: dict[str, Any] = {name: np.array([getattr(s, name) for s in samples], dtype=dtype)
                            for name, dtype in _SCALARS.items()}
    cols["status"] = [s.status for s in samples]
    cols["prompt_lengths"] = np.array([len(s.prompt_ids) for s in samples], dtype=np.int64)
    cols["response_lengths"] = np.array([len(s.response_ids) for s in samples], dtype=np.int64)
    for name, dtype in _TOKEN_ARRAYS.items():
        cols[name] = (np.concatenate([getattr(s, name) for s in samples]) if samples
                      else np.zeros(0, dtype))
    P, R = cols["prompt_lengths"], cols["response_lengths"]
    for row in trace_table.TRACES:
        packed = pack_rows([getattr(s, row.name) for s in samples])
        cols[row.name] = (trace_storage.encode_column(row, packed, trace_table.rows_in(row, P, R))
                          if compact else packed)
    return cols


def trace_bytes_per_token(columns: Mapping[str, Any]) -> dict[str, float]:
    """What a batch's traces cost on the wire, per trajectory token, from its columns as they
    travel (:func:`samples_to_columns`'s result, before :func:`samples_from_columns` decodes
    them): the bytes of the arrays each trace column holds
    (:func:`replayrl.rollout.traces.trace_storage.wire_nbytes`: the compact codecs' arrays, a
    raw column's int32) over the batch's ``sum(P + R)`` tokens. Nothing is encoded again.

    Returns:
        ``{"trace_bytes_per_token": all traces' bytes / tokens}`` plus
        ``"<trace>_bytes_per_token"`` (e.g. ``routed_experts_bytes_per_token``) for each trace
        some sample carries (a column not ``None``); floats, bytes per token. ``{}`` for a
        batch of no tokens.
    Raises:
        SampleError: missing length columns or a trace column in no wire form (named, sample
            ``"batch"``).
    """
    tokens = 0
    for name in ("prompt_lengths", "response_lengths"):
        if name not in columns:
            raise SampleError("batch", name, "missing column")
        tokens += int(np.asarray(columns[name], dtype=np.int64).sum())
    if tokens <= 0:
        return {}
    out: dict[str, float] = {}
    total = 0
    for row in trace_table.TRACES:
        column = columns.get(row.name)
        if column is None:
            continue
        try:
            nbytes = trace_storage.wire_nbytes(column)
        except ValueError as exc:
            raise SampleError("batch", row.name, str(exc)) from None
        out[f"{row.name}_bytes_per_token"] = nbytes / tokens
        total += nbytes
    return {"trace_bytes_per_token": total / tokens, **out}


def samples_from_columns(columns: Mapping[str, Any], decode_threads: int = 1) -> list[Sample]:
    """Rebuild the samples of :func:`samples_to_columns` (e.g. a decoded message).

    Encoded trace columns are decoded first (each indexer row's keys come back ascending, ``-1``
    after: the same set; :mod:`replayrl.rollout.traces.trace_storage`), a ``"sets"`` column's rows on
    ``decode_threads`` (int ``>= 1``) threads; the result does not depend on it. Each sample's
    arrays are views into the columns (no copy when the columns are read-only, as decoded
    messages are) and every sample passes :func:`check_contract`, the check
    :class:`Sample` makes at any other construction (here once for the whole batch).

    Raises:
        SampleError: ``decode_threads`` not an int >= 1 (field ``decode_threads``), a missing or
            unknown column, an id or version column that is not integers, a column whose length
            disagrees with the lengths (named by the column; the sample is ``"batch"`` when no
            single sample is at fault), or a sample violating the contract (named by its
            ``sample_id``).
    """
    if not isinstance(columns, Mapping):
        raise SampleError("batch", "<message>", f"expected a mapping of columns, got "
                                                f"{type(columns).__name__}")
    if type(decode_threads) is not int or decode_threads < 1:
        raise SampleError("batch", "decode_threads", f"expected an int >= 1, got {decode_threads!r}")
    traces = trace_table.TRACES
    names = {*_SCALARS, "status", "prompt_lengths", "response_lengths", *_TOKEN_ARRAYS,
             *(row.name for row in traces)}
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
    decoded = {}
    for row in traces:
        try:
            decoded[row.name] = trace_storage.decode_column(row, columns[row.name],
                                                            trace_table.rows_in(row, P, R),
                                                            threads=decode_threads)
        except ValueError as exc:
            raise SampleError("batch", row.name, str(exc)) from None
    columns = {**columns, **decoded}
    scalars = {}
    for name in _SCALARS:
        arr = np.asarray(columns[name])
        if arr.shape != (n,):
            raise SampleError("batch", name, f"shape {arr.shape}, expected ({n},)")
        if name in _INT_SCALARS and n and arr.dtype.kind not in "iu":
            raise SampleError("batch", name, f"expected integers, got {arr.dtype}")
        scalars[name] = arr.tolist()
    rows = {"prompt_ids": P, **{name: R for name in _TOKEN_ARRAYS if name != "prompt_ids"},
            **{row.name: trace_table.rows_in(row, P, R) for row in traces}}
    split = {}
    for name, counts in rows.items():
        try:
            split[name] = unpack_rows(columns[name], counts)
        except ValueError as exc:
            raise SampleError("batch", name, str(exc)) from None
    names = [*_SCALARS, "status", *rows]
    per_sample = [dict(zip(names, values)) for values in zip(
        *(scalars[name] for name in _SCALARS), columns["status"], *(split[name] for name in rows))]
    if not _columns_are_frozen_views(columns, traces):
        # arrays to convert or copy: each sample converts its own (and checks the contract)
        return [Sample(**kw) for kw in per_sample]
    # the same contract check Sample makes, once for the whole batch (about 30 us per sample
    # saved); the samples' arrays are then read-only views of the columns
    check_contract(scalars["sample_id"], P, R, columns["loss_mask"], columns["rollout_logprobs"],
                   columns["status"], scalars["reward"],
                   np.asarray(scalars["synthetic_eos"], dtype=bool), columns.get("sample_support"))
    return [_checked_sample(**kw) for kw in per_sample]


def _columns_are_frozen_views(columns: Mapping[str, Any], traces: Sequence[Any]) -> bool:
    """True when every array column already has its field's dtype and rank and is read-only,
    so the samples may hold views of it unchanged (a writable column would let the caller
    mutate samples); a trace column may also be ``None`` (no sample has it). A list column
    (ragged traces) is False: its samples are built one by one."""
    wanted = {**{name: (dtype, 1) for name, dtype in _TOKEN_ARRAYS.items()},
              **{row.name: (row.dtype, row.ndim) for row in traces}}
    trace_names = {row.name for row in traces}
    for name, (dtype, ndim) in wanted.items():
        value = columns[name]
        if value is None and name in trace_names:
            continue
        if (not isinstance(value, np.ndarray) or value.dtype != dtype or value.ndim != ndim
                or value.flags.writeable):
            return False
    return True


def _checked_sample(**fields: Any) -> Sample:
    """A Sample whose fields passed :func:`check_contract` as frozen views (no second check)."""
    sample = object.__new__(Sample)
    sample.__dict__.update(fields)  # a frozen dataclass's fields live in its __dict__
    return sample
