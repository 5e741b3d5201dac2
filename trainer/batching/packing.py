"""Packed microbatches: one layout, built once, applied to tokens, masks and every trace.

A packed microbatch concatenates ``B`` trajectories into one token axis of ``T`` positions
(the "THD" layout of flash-attention / TransformerEngine) instead of right-padding them to a
common length (``trainer/batching/batch.py``). Padding and shifting by hand per array is where token
rows drift apart, so every per-token array -- tokens, loss masks, rollout logprobs, support
rows, routing and indexer traces -- goes through the same frozen :class:`PackedLayout`:

* segment ``i`` holds sample ``i`` (input order is the canonical order) at packed positions
  ``[cu_seqlens_padded[i], cu_seqlens_padded[i] + lengths[i])``, followed by padding up to a
  multiple of ``pad_to_multiple_of``;
* ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (segment starts in the buffer) follow
  TransformerEngine / Megatron-LM ``PackedSeqParams`` naming; ``position_ids`` restart at 0 in
  every segment (padding positions keep counting, so they stay valid RoPE positions);
* the next-token shift never crosses a segment: position ``p`` predicts token ``p + 1`` of the
  same segment, and the last real position of every segment (and every padding position)
  predicts nothing (:meth:`PackedLayout.next_token_targets`, ``tests/cases/packed_shift.json``);
* a layout built for context parallelism (CP) of size ``c`` (``from_lengths(..., cp_size=c)``)
  pads every segment to a multiple of ``2c``, so :mod:`replayrl.trainer.parallel.context_parallel` can
  cut it into the load-balanced shards of Megatron-LM / TransformerEngine.

Row spaces. Per-sample arrays do not all start at the sample's first token: a trajectory of
prompt length ``P`` and ``R`` response tokens has ``P + R`` tokens, ``P + R - 1`` trace rows
(the last token is never forwarded) and ``R`` response rows (``sample_support``, ``loss_mask``,
``rollout_logprobs``), the response row ``j`` belonging to the position ``P - 1 + j`` whose
logits predict it. :meth:`PackedLayout.pack` / :meth:`PackedLayout.unpack` therefore take
optional per-sample ``offsets`` (first position of the array inside its segment): ``None`` for
token arrays (exactly ``lengths[i]`` rows), ``0`` for traces, ``P - 1`` for response rows. Every
position an array does not cover gets ``pad_value`` (``-1`` trace rows = "use own choice";
``-1`` support rows = padding rows).

Indexer traces hold key slots, which equal token positions inside a sample (right padding keeps
slot == position). Packed, the key of sample position ``k`` sits at packed position
``cu_seqlens_padded[i] + k``; :meth:`PackedLayout.pack_key_slots` /
:meth:`PackedLayout.unpack_key_slots` apply and undo that offset.

Arrays may be numpy arrays or torch tensors (any trailing shape); torch outputs stay on the
input device and keep autograd (pack / unpack of logprobs are differentiable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from replayrl.trainer.errors import PackedFieldError, PackingError

__all__ = [
    "PackedLayout",
    "IGNORE_INDEX",
]

IGNORE_INDEX = -100
"""Default "no target" value of :meth:`PackedLayout.next_token_targets` (torch's
``cross_entropy`` ignore_index)."""


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PackingError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _is_torch(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _offset_slots(a: Any, delta: int) -> Any:
    """Add ``delta`` to the key slots (entries >= 0) of ``a``, keeping -1 and the dtype."""
    if _is_torch(a):
        return torch.where(a >= 0, a + delta, a)
    return np.where(a >= 0, a + delta, a).astype(a.dtype, copy=False)


def _check_fill(value: Any, dtype: Any, what: str) -> None:
    """Reject a fill value the dtype cannot hold (e.g. -1 in a uint8 mask): never wrap silently."""
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point or dtype.is_complex:
            return
        if dtype == torch.bool:
            ok = value in (0, 1) and not isinstance(value, float)
            info = None
        else:
            info = torch.iinfo(dtype)
    else:
        dtype = np.dtype(dtype)
        if dtype.kind in "fc":
            return
        if dtype.kind == "b":
            ok = value in (0, 1) and not isinstance(value, float)
            info = None
        elif dtype.kind in "iu":
            info = np.iinfo(dtype)
        else:
            raise PackingError(f"{what}: unsupported dtype {dtype}")
    if info is not None:
        ok = (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
              and info.min <= value <= info.max)
    if not ok:
        raise PackingError(f"{what} {value!r} cannot be stored in dtype {dtype}")


@dataclass(frozen=True)
class PackedLayout:
    """Where each of ``B`` samples lives in a packed microbatch of ``T`` positions.

    Build it once per microbatch (``PackedLayout.from_lengths``) and pass every per-token array
    through it. Two layouts are equal when their lengths and multiple are equal.

    Attributes:
        lengths: real token count of each sample (``P + R``), in canonical (input) order, >= 1.
        pad_to_multiple_of: every segment is padded to a multiple of this (>= 1).
        sample_ids: optional names of the samples for error messages (default: ``#index``).
        padded_lengths: segment lengths after padding.
        total_length: ``T = sum(padded_lengths)``.
        cu_seqlens: int32 [B+1] cumulative real lengths (flash-attention / TE ``cu_seqlens``).
        cu_seqlens_padded: int32 [B+1] segment starts in the packed buffer (TE
            ``cu_seqlens_padded``); equal to ``cu_seqlens`` when nothing is padded.
        position_ids: int64 [T] position inside the segment, restarting at 0 per segment.
        segment_ids: int64 [T] sample index of each position (block-diagonal attention).
        real_mask: bool [T] True at real tokens, False at padding.
        target_mask: bool [T] True where position ``p`` has a next-token target, i.e.
            ``p + 1`` is a real token of the same segment.

    All arrays are read-only numpy arrays.

    Raises:
        PackingError: empty ``lengths``, a length < 1, or a bad multiple.
    """

    lengths: tuple[int, ...]
    pad_to_multiple_of: int = 1
    sample_ids: tuple[Any, ...] | None = field(default=None, compare=False)
    padded_lengths: tuple[int, ...] = field(init=False, compare=False)
    total_length: int = field(init=False, compare=False)
    cu_seqlens: np.ndarray = field(init=False, repr=False, compare=False)
    cu_seqlens_padded: np.ndarray = field(init=False, repr=False, compare=False)
    position_ids: np.ndarray = field(init=False, repr=False, compare=False)
    segment_ids: np.ndarray = field(init=False, repr=False, compare=False)
    real_mask: np.ndarray = field(init=False, repr=False, compare=False)
    target_mask: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            lengths = tuple(self.lengths)
        except TypeError:
            raise PackingError(f"lengths must be a sequence of ints, got {self.lengths!r}") from None
        if not lengths:
            raise PackingError("lengths is empty: a packed microbatch needs at least one sample")
        multiple = _positive_int(self.pad_to_multiple_of, "pad_to_multiple_of")
        if self.sample_ids is not None:
            ids = tuple(self.sample_ids)
            if len(ids) != len(lengths):
                raise PackingError(f"sample_ids has {len(ids)} entries for {len(lengths)} lengths")
            object.__setattr__(self, "sample_ids", ids)
        checked = []
        for i, n in enumerate(lengths):
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
                raise PackedFieldError(self.sample_name(i), "length", f"must be an int >= 1, got {n!r}")
            checked.append(int(n))
        lengths = tuple(checked)
        padded = tuple(-(-n // multiple) * multiple for n in lengths)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "pad_to_multiple_of", multiple)
        object.__setattr__(self, "padded_lengths", padded)
        total = int(sum(padded))
        object.__setattr__(self, "total_length", total)
        cu = np.zeros(len(lengths) + 1, np.int64)
        cu[1:] = np.cumsum(lengths)
        cu_pad = np.zeros(len(lengths) + 1, np.int64)
        cu_pad[1:] = np.cumsum(padded)
        if cu_pad[-1] > np.iinfo(np.int32).max:
            raise PackingError(f"packed length {cu_pad[-1]} does not fit the int32 cu_seqlens")
        seg = np.repeat(np.arange(len(lengths), dtype=np.int64), padded)
        pos = np.arange(total, dtype=np.int64) - cu_pad[seg]
        real = pos < np.asarray(lengths, np.int64)[seg]
        target = pos + 1 < np.asarray(lengths, np.int64)[seg]
        object.__setattr__(self, "cu_seqlens", _readonly(cu.astype(np.int32)))
        object.__setattr__(self, "cu_seqlens_padded", _readonly(cu_pad.astype(np.int32)))
        object.__setattr__(self, "position_ids", _readonly(pos))
        object.__setattr__(self, "segment_ids", _readonly(seg))
        object.__setattr__(self, "real_mask", _readonly(real))
        object.__setattr__(self, "target_mask", _readonly(target))

    # ----------------------------------------------------------------------- construction

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], *, pad_to_multiple_of: int = 1, cp_size: int = 1,
                     sample_ids: Sequence[Any] | None = None) -> "PackedLayout":
        """Layout for samples of ``lengths`` tokens, ready for context parallelism of ``cp_size``.

        The segment multiple is ``lcm(pad_to_multiple_of, 2 * cp_size)`` when ``cp_size > 1``
        (each segment must split into ``2 * cp_size`` equal chunks), else ``pad_to_multiple_of``.

        Raises:
            PackingError: as the constructor, or a non-positive ``cp_size``.
        """
        multiple = _positive_int(pad_to_multiple_of, "pad_to_multiple_of")
        cp = _positive_int(cp_size, "cp_size")
        if cp > 1:
            multiple = math.lcm(multiple, 2 * cp)
        return cls(tuple(lengths), multiple,
                   None if sample_ids is None else tuple(sample_ids))

    @property
    def num_samples(self) -> int:
        """``B``, the number of segments."""
        return len(self.lengths)

    def sample_name(self, i: int) -> Any:
        """Name of sample ``i`` in error messages: ``sample_ids[i]``, or ``#i`` without ids."""
        return self.sample_ids[i] if self.sample_ids is not None else f"#{i}"

    # ----------------------------------------------------------------------- pack / unpack

    def _spans(self, rows: Sequence[int], offsets: Sequence[int] | None, field_name: str
               ) -> list[int]:
        """Validate per-sample row counts against the segments; return each array's start."""
        starts = []
        if offsets is not None:
            offsets = list(offsets)
            if len(offsets) != self.num_samples:
                raise PackingError(f"{field_name}: {len(offsets)} offsets for {self.num_samples} samples")
        for i, n in enumerate(rows):
            if offsets is None:
                if n != self.lengths[i]:
                    raise PackedFieldError(self.sample_name(i), field_name,
                                           f"{n} rows, but the sample has {self.lengths[i]} tokens")
                off = 0
            else:
                off = offsets[i]
                if isinstance(off, (bool, np.bool_)) or not isinstance(off, (int, np.integer)):
                    raise PackedFieldError(self.sample_name(i), field_name, f"offset {off!r} is not an int")
                if off < 0 or off + n > self.lengths[i]:
                    raise PackedFieldError(
                        self.sample_name(i), field_name,
                        f"{n} rows at offset {off} do not fit the sample's {self.lengths[i]} tokens")
            starts.append(int(self.cu_seqlens_padded[i]) + int(off))
        return starts

    def pack(self, arrays: Sequence[Any], pad_value: Any, *, field: str = "array",
             offsets: Sequence[int] | None = None) -> Any:
        """Concatenate per-sample arrays ``[n_i, *trailing]`` into one packed ``[T, *trailing]``.

        Args:
            arrays: one numpy array (or array-like) or torch tensor per sample, in canonical
                order, all of one dtype and trailing shape (all numpy or all torch).
            pad_value: value of every position no array covers (padding, uncovered rows); must
                fit the dtype (``-1`` into uint8 is an error, not a wrap-around).
            field: name used in error messages (e.g. ``"routed_experts"``).
            offsets: first position of each array inside its segment; ``None`` means each array
                covers its whole sample (``n_i == lengths[i]``). With offsets each array must
                fit: ``0 <= offsets[i]`` and ``offsets[i] + n_i <= lengths[i]``.

        Returns:
            numpy array or torch tensor ``[T, *trailing]`` of the arrays' dtype (torch: on the
            first array's device, differentiable w.r.t. the inputs).

        Raises:
            PackedFieldError: a row count, dtype or trailing shape mismatch (names sample, field).
            PackingError: wrong number of arrays or offsets, or an unstorable ``pad_value``.
        """
        arrays = list(arrays)
        if len(arrays) != self.num_samples:
            raise PackingError(f"{field}: {len(arrays)} arrays for {self.num_samples} samples")
        use_torch = any(_is_torch(a) for a in arrays)
        if use_torch and not all(_is_torch(a) for a in arrays):
            raise PackingError(f"{field}: mix of torch tensors and numpy arrays")
        if not use_torch:
            arrays = [np.asarray(a) for a in arrays]
        first = arrays[0]
        for i, a in enumerate(arrays):
            if a.ndim < 1:
                raise PackedFieldError(self.sample_name(i), field, "is a scalar, needs a row axis")
            if tuple(a.shape[1:]) != tuple(first.shape[1:]) or a.dtype != first.dtype:
                raise PackedFieldError(
                    self.sample_name(i), field,
                    f"rows of shape {tuple(a.shape[1:])} and dtype {a.dtype}, but sample "
                    f"{self.sample_name(0)} has {tuple(first.shape[1:])} and {first.dtype}")
        _check_fill(pad_value, first.dtype, f"{field}: pad_value")
        starts = self._spans([a.shape[0] for a in arrays], offsets, field)
        dst = np.concatenate([s + np.arange(a.shape[0]) for s, a in zip(starts, arrays)])
        shape = (self.total_length,) + tuple(first.shape[1:])
        if use_torch:
            out = torch.full(shape, pad_value, dtype=first.dtype, device=first.device)
            index = torch.from_numpy(dst).to(first.device)
            return out.index_copy(0, index, torch.cat(arrays))
        out = np.full(shape, pad_value, dtype=first.dtype)
        out[dst] = np.concatenate(arrays)
        return out

    def unpack(self, packed: Any, *, field: str = "packed", offsets: Sequence[int] | None = None,
               rows: Sequence[int] | None = None) -> list[Any]:
        """Per-sample views of a packed ``[T, *trailing]`` array, in canonical order.

        Args:
            packed: numpy array or torch tensor with ``T`` rows.
            field: name used in error messages.
            offsets, rows: which rows of each segment to return: ``rows[i]`` rows from
                ``offsets[i]``. Default: the whole real part of each segment (padding dropped);
                ``offsets`` defaults to 0 and ``rows`` to ``lengths[i] - offsets[i]``.

        Returns:
            list of ``B`` views (numpy views / differentiable torch slices) ``[rows_i, *trailing]``.

        Raises:
            PackingError: ``packed`` has the wrong number of rows, or bad offsets / rows.
            PackedFieldError: a requested span does not fit its sample.
        """
        self.check_packed(packed, field)
        offs = [0] * self.num_samples if offsets is None else list(offsets)
        if len(offs) != self.num_samples:
            raise PackingError(f"{field}: {len(offs)} offsets for {self.num_samples} samples")
        if rows is None:
            n_rows = [n - int(o) for n, o in zip(self.lengths, offs)]
        else:
            n_rows = list(rows)
            if len(n_rows) != self.num_samples:
                raise PackingError(f"{field}: {len(n_rows)} row counts for {self.num_samples} samples")
        for i, n in enumerate(n_rows):
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
                raise PackedFieldError(self.sample_name(i), field, f"row count {n!r} is not an int >= 0")
        starts = self._spans(n_rows, offs, field)
        return [packed[s : s + int(n)] for s, n in zip(starts, n_rows)]

    def check_packed(self, packed: Any, field: str) -> None:
        """Check that ``packed`` is a numpy array or torch tensor ``[T, ...]`` of this layout.

        Raises:
            PackingError: another type, a scalar, or a row count other than ``total_length``
                (the message names ``field``).
        """
        if not (_is_torch(packed) or isinstance(packed, np.ndarray)) or packed.ndim < 1:
            raise PackingError(f"{field} must be a numpy array or torch tensor [T, ...], got "
                               f"{type(packed).__name__}")
        if packed.shape[0] != self.total_length:
            raise PackingError(f"{field} has {packed.shape[0]} rows, the layout packs "
                               f"{self.total_length}")

    # ----------------------------------------------------------------------- key slots

    def pack_key_slots(self, arrays: Sequence[Any], *, field: str = "indexer_topk",
                       offsets: Sequence[int] | None = None) -> Any:
        """:meth:`pack` for indexer traces: key slots (sample positions) become packed positions.

        Each non-negative entry ``k`` of sample ``i`` becomes ``cu_seqlens_padded[i] + k``;
        ``-1`` (no key) stays ``-1`` and fills every uncovered position.

        Raises:
            PackedFieldError: a key slot outside ``[-1, lengths[i])`` (a key of no token of the
                sample), or as :meth:`pack`.
        """
        shifted = []
        for i, a in enumerate(arrays):
            a = a if _is_torch(a) else np.asarray(a)
            integer = (not a.is_floating_point() and not a.is_complex() and a.dtype != torch.bool
                       if _is_torch(a) else a.dtype.kind in "iu")
            if not integer:
                raise PackedFieldError(self.sample_name(i), field, f"key slots must be integers, got {a.dtype}")
            if (a.numel() if _is_torch(a) else a.size) > 0:
                lo, hi = int(a.min()), int(a.max())
                if lo < -1 or hi >= self.lengths[i]:
                    raise PackedFieldError(self.sample_name(i), field,
                                           f"key slots must lie in [-1, {self.lengths[i]}), got [{lo}, {hi}]")
            shifted.append(_offset_slots(a, int(self.cu_seqlens_padded[i])))
        return self.pack(shifted, -1, field=field, offsets=offsets)

    def unpack_key_slots(self, packed: Any, *, field: str = "indexer_topk",
                         offsets: Sequence[int] | None = None,
                         rows: Sequence[int] | None = None) -> list[Any]:
        """Inverse of :meth:`pack_key_slots`: per-sample arrays of sample-relative key slots.

        Raises:
            PackedFieldError: a key slot outside its own segment's real tokens (a key that
                crosses samples would leak one trajectory into another), or as :meth:`unpack`.
        """
        out = []
        for i, a in enumerate(self.unpack(packed, field=field, offsets=offsets, rows=rows)):
            start, n = int(self.cu_seqlens_padded[i]), self.lengths[i]
            bad = (a >= 0) & ((a < start) | (a >= start + n))
            if bool(bad.any()):
                raise PackedFieldError(self.sample_name(i), field,
                                       f"key slots outside the segment's positions [{start}, {start + n})")
            out.append(_offset_slots(a, -start))
        return out

    # ----------------------------------------------------------------------- next-token shift

    def shift_to_next(self, packed: Any, fill_value: Any, *, field: str = "packed") -> Any:
        """Row ``p + 1`` at row ``p`` inside each segment, ``fill_value`` where there is none.

        ``out[p] = packed[p + 1]`` where ``target_mask[p]`` (``p + 1`` is a real token of the
        same segment), else ``fill_value``: the last real position of every segment and every
        padding position. Use it for targets (:meth:`next_token_targets`) and for arrays aligned
        to tokens that must be aligned to the predicting position (e.g. a per-token loss mask).

        Args:
            packed: numpy array or torch tensor ``[T, *trailing]``.
            fill_value: value where there is no next row; must fit the dtype.

        Returns:
            same type, shape and dtype as ``packed``.

        Raises:
            PackingError: wrong row count or an unstorable ``fill_value``.
        """
        self.check_packed(packed, field)
        _check_fill(fill_value, packed.dtype, f"{field}: fill_value")
        shape = (-1,) + (1,) * (packed.ndim - 1)
        if _is_torch(packed):
            nxt = torch.cat([packed[1:], packed[-1:]])
            mask = torch.tensor(self.target_mask, device=packed.device).reshape(shape)
            return torch.where(mask, nxt, torch.full_like(packed, fill_value))
        nxt = np.concatenate([packed[1:], packed[-1:]])
        return np.where(self.target_mask.reshape(shape), nxt, np.asarray(fill_value, packed.dtype))

    def next_token_targets(self, tokens: Any, ignore_index: int = IGNORE_INDEX) -> Any:
        """Next-token target of every packed position, ``ignore_index`` where there is none.

        Position ``p`` predicts token ``p + 1`` of the SAME segment; the last real position of
        each segment and every padding position get ``ignore_index`` (see
        ``tests/cases/packed_shift.json``). ``target_mask`` is the matching bool mask.

        Args:
            tokens: packed token ids, integer numpy array or torch tensor [T].
            ignore_index: "no target" value (default -100, torch's cross-entropy ignore index).

        Returns:
            same type and dtype as ``tokens``, [T].

        Raises:
            PackingError: ``tokens`` is not 1-D integer with ``T`` entries, or ``ignore_index``
                does not fit its dtype.
        """
        self.check_packed(tokens, "tokens")
        is_int = (not tokens.is_floating_point() and tokens.dtype != torch.bool) if _is_torch(tokens) \
            else tokens.dtype.kind in "iu"
        if tokens.ndim != 1 or not is_int:
            raise PackingError(f"tokens must be a 1-D integer array [T], got shape "
                               f"{tuple(tokens.shape)} and dtype {tokens.dtype}")
        return self.shift_to_next(tokens, ignore_index, field="tokens")
