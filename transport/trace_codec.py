"""Compact, exact storage of int trace arrays: narrow ids and sorted index sets (numpy only).

Two codecs for ``[rows, ..., K]`` int arrays whose ``-1`` means "nothing here", each a plain
mapping of small numpy arrays the transport codec sends out of band
(docs/design/traces.md#trace-arrays):

* :func:`encode_ids` / :func:`decode_ids` -- ids from a small alphabet (e.g. expert ids): the
  values in the smallest unsigned dtype that holds the largest one (uint8 up to 255, so up to
  256 experts), rows that are all ``-1`` listed in a bitmap and not stored; if some row mixes
  ``-1`` with ids, every value is stored ``+ 1`` instead. Decoding gives back the very array
  (same values, same order).
* :func:`encode_sets` / :func:`decode_sets` -- each row a SET of distinct indices into its own
  universe ``[0, n_r)`` (e.g. the keys a causal query at position ``p`` may see, ``n_r = p + 1``).
  A row stores as one of: *empty* (all ``-1``, no payload), *all* (every index of the universe,
  possible when ``n_r <= K``; no payload: it is implied by ``n_r``), a *bitmap* of ``n_r`` bits,
  or *Elias-Fano*: the sorted indices ``s_j`` (``c`` of them) split at a width ``l`` chosen per
  row into low parts ``s_j & (2**l - 1)`` (``l`` bits each) and high parts ``s_j >> l``, the
  bucket of the index; the high stream holds, for each of the row's ``((n_r - 1) >> l) + 1``
  buckets in turn, a ``1`` per index in that bucket and then a ``0``, so ``c * (l + 1) +
  ((n_r - 1) >> l) + 1`` bits a row (within about 2 bits an index of ``log2 C(n_r, c)``). The
  smaller of bitmap and Elias-Fano is kept. Decoding gives the set in canonical order:
  ascending, ``-1`` after. Order within a row is not carried (a row is a set: the readers of
  such traces build masks or compare sets); everything else is exact.

Decoding is vectorised over all rows at once (no Python loop per row, only per bit plane):
bit streams are unpacked with ``np.unpackbits`` and read with ``np.flatnonzero``; an
Elias-Fano index is ``bucket << l | low``, its bucket the position of its ``1`` in the high
stream less the indices before it, its low part read from bit planes: no running sum over the
indices is needed (which Rice-coded gaps would).

Bits are packed MSB first (``np.packbits``), rows back to back with no padding between them.
Set-codec layout (``M`` = number of rows, i.e. the product of every axis but the last)::

    {"codec": "sets", "shape": [..., K], "kind": uint8 [M] (0 empty, 1 all, 2 bitmap,
     3 Elias-Fano), "count": uint16|uint32 [rows of kind 2 and 3], "width": uint8 [rows of
     kind 3], "bitmap": uint8 [...], "high": uint8 [...], "low": uint8 [...]}

The ``bitmap`` and ``high`` streams hold their rows in row order; ``low`` holds bit planes,
least significant first: plane ``b`` holds bit ``b`` of every index of the Elias-Fano rows wider
than ``b``, in row order, each row's part padded to whole bytes. So a run of consecutive rows is
a contiguous run of bits of ``bitmap`` and ``high`` and of bytes of each plane: chunks of rows
decode independently (:func:`decode_sets` with ``threads``).

Ids layout: ``{"codec": "ids", "shape": [...], "pad_rows": uint8 packed bits [M], "values":
uintX [M - padded, K]}`` or ``{"codec": "ids+1", "shape": [...], "values": uintX [...]}``.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, NamedTuple

import numpy as np

from replayrl.transport.errors import TraceCodecError

__all__ = ["EMPTY", "ALL", "BITMAP", "ELIAS_FANO", "TraceCodecError", "SetsHeader", "canonical_sets",
           "encode_ids", "decode_ids", "encode_sets", "decode_sets", "read_sets_header", "encoded_nbytes"]

EMPTY, ALL, BITMAP, ELIAS_FANO = 0, 1, 2, 3
"""Row kinds of the set codec."""

_MAX_WIDTH = 31
"""Largest Elias-Fano width (low bits per index); universes below 2**32 never need more."""


def _unsigned_for(top: int) -> np.dtype:
    """The smallest unsigned dtype holding ``0..top``."""
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if top <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise TraceCodecError(f"value {top} does not fit in 64 bits")


def encoded_nbytes(encoded: Mapping[str, Any]) -> int:
    """Bytes of the arrays of an encoded trace (what travels out of band; the few msgpack
    header bytes of its keys and shape not counted)."""
    return sum(v.nbytes for v in encoded.values() if isinstance(v, np.ndarray))


# -- ids ---------------------------------------------------------------------------------------
def encode_ids(array: np.ndarray) -> dict[str, Any]:
    """Store an int array of ids ``>= -1`` (``-1`` = none) in the smallest unsigned dtype.

    Args:
        array: int array ``[rows, ..., K]`` (any int dtype), rank >= 1; the last axis is a row.
    Returns:
        the ids layout of the module docstring.
    Raises:
        TraceCodecError: a value below ``-1`` or a non-integer array.
    """
    a = np.asarray(array)
    if a.dtype.kind not in "iu" or a.ndim < 1:
        raise TraceCodecError(f"ids: expected an int array of rank >= 1, got {a.dtype} {a.shape}")
    flat = a.reshape(math.prod(a.shape[:-1]), a.shape[-1])
    low = int(flat.min()) if flat.size else 0
    if low < -1:
        raise TraceCodecError(f"ids: value {low} below -1")
    top = int(flat.max()) if flat.size else 0
    missing = flat < 0
    pad = missing.all(axis=1)
    shape = [int(d) for d in a.shape]
    if missing.any(axis=1)[~pad].any():  # -1 inside a row of ids: store value + 1
        return {"codec": "ids+1", "shape": shape,
                "values": (a.astype(np.int64) + 1).astype(_unsigned_for(top + 1))}
    return {"codec": "ids", "shape": shape, "pad_rows": np.packbits(pad),
            "values": flat[~pad].astype(_unsigned_for(max(top, 0)))}


def decode_ids(encoded: Mapping[str, Any], dtype: Any = np.int32) -> np.ndarray:
    """Inverse of :func:`encode_ids`: the array (``dtype``, default int32), equal to the one
    encoded, new and writable.

    Raises:
        TraceCodecError: a malformed encoding (sizes disagreeing with the shape).
    """
    shape = _shape(encoded)
    values = _array(encoded, "values")
    if encoded.get("codec") == "ids+1":
        if values.shape != shape:
            raise TraceCodecError(f"ids: values {values.shape} for shape {shape}")
        return values.astype(dtype) - 1
    if encoded.get("codec") != "ids":
        raise TraceCodecError(f"ids: unknown codec {encoded.get('codec')!r}")
    k = shape[-1]
    m = math.prod(shape[:-1])
    packed = _array(encoded, "pad_rows")
    if packed.size != (m + 7) // 8:
        raise TraceCodecError(f"ids: pad_rows of {packed.size} bytes for {m} rows")
    pad = np.unpackbits(packed, count=m).astype(bool)
    if values.shape != (m - int(pad.sum()), k):
        raise TraceCodecError(f"ids: values {values.shape} for {m - int(pad.sum())} rows of {k}")
    out = np.full((m, k), -1, dtype=dtype)
    out[~pad] = values
    return out.reshape(shape)


# -- sets --------------------------------------------------------------------------------------
def canonical_sets(array: np.ndarray) -> np.ndarray:
    """Each row of ``array`` (int ``[..., K]``, ``-1`` = empty slot) with its indices ascending
    and its ``-1`` slots after them: what :func:`decode_sets` gives back. A new array."""
    a = np.asarray(array)
    big = np.iinfo(np.int64).max
    s = np.sort(np.where(a < 0, big, a.astype(np.int64)), axis=-1)
    return np.where(s == big, -1, s).astype(a.dtype)


def encode_sets(array: np.ndarray, universe: np.ndarray) -> dict[str, Any] | None:
    """Store each row of ``array`` as a set of indices into ``[0, universe[r])``.

    Args:
        array: int ``[N, ..., K]``: entries are indices or ``-1`` (empty slot), in any order.
        universe: int ``[N]``, each leading row's universe size ``n >= 0`` (shared by the rows
            of its trailing axes but the last; e.g. ``position + 1`` keys for a causal query).
    Returns:
        the sets layout of the module docstring; ``None`` when some row is no set of its
        universe (a value below ``-1`` or at least ``n``, or a repeated index): the caller keeps
        such an array as it is.
    Raises:
        TraceCodecError: ``universe`` does not match the leading axis or is negative.
    """
    a = np.asarray(array)
    n_lead = np.asarray(universe, dtype=np.int64)
    if a.dtype.kind not in "iu" or a.ndim < 2 or n_lead.shape != a.shape[:1] or (n_lead < 0).any():
        raise TraceCodecError(f"sets: array {a.dtype} {a.shape} with universe {n_lead.shape}")
    k = a.shape[-1]
    rows = a.reshape(-1, k).astype(np.int64)
    n = np.repeat(n_lead, math.prod(a.shape[1:-1]))
    srt = np.sort(np.where(rows < 0, -1, rows), axis=-1)  # -1 first, then ascending
    if (rows < -1).any() or (srt[:, -1] >= n).any() or (
            (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any():
        return None
    count = (srt >= 0).sum(axis=1)
    # ascending indices left-aligned: row r's j-th index at [r, j], j < count[r]
    srt = np.sort(np.where(srt < 0, np.iinfo(np.int64).max, srt), axis=-1)
    valid = np.arange(k)[None, :] < count[:, None]
    srt = np.where(valid, srt, 0)
    kind = np.where(count == 0, EMPTY, np.where(count == n, ALL, BITMAP)).astype(np.uint8)
    coded = kind == BITMAP
    width, ef_bits = _best_width(count[coded], n[coded])
    use_ef = np.zeros(len(kind), bool)
    use_ef[coded] = ef_bits + 8 < n[coded]  # + the row's width byte
    kind[use_ef] = ELIAS_FANO
    bm_rows = kind == BITMAP
    # bitmap stream: each bitmap row's n bits, back to back
    starts = np.cumsum(n[bm_rows]) - n[bm_rows]
    bits = np.zeros(int(n[bm_rows].sum()), np.uint8)
    bits[(starts[:, None] + srt[bm_rows])[valid[bm_rows]]] = 1
    # Elias-Fano rows, in row order
    ef_w, ef_count, ef_n = width[use_ef[coded]], count[use_ef], n[use_ef]
    values = srt[use_ef][valid[use_ef]]  # each row's indices ascending, rows back to back
    w_elem = np.repeat(ef_w, ef_count)
    row_bits = ef_count + ((ef_n - 1) >> ef_w) + 1
    local = np.arange(len(values)) - np.repeat(np.cumsum(ef_count) - ef_count, ef_count)
    high = np.zeros(int(row_bits.sum()), np.uint8)
    high[np.repeat(np.cumsum(row_bits) - row_bits, ef_count) + (values >> w_elem) + local] = 1
    return {"codec": "sets", "shape": [int(d) for d in a.shape], "kind": kind,
            "count": count[kind >= BITMAP].astype(np.uint16 if k <= np.iinfo(np.uint16).max else np.uint32),
            "width": ef_w.astype(np.uint8), "bitmap": np.packbits(bits), "high": np.packbits(high),
            "low": _pack_planes(values, local, ef_w, ef_count)}


def _best_width(count: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row (``count`` indices of a universe of ``n``) the Elias-Fano width ``l`` minimising
    the coded bits ``count * (l + 1) + ((n - 1) >> l) + 1``, and those bits; tries the three
    widths around ``log2(n / count)``, the larger on a tie (fewer buckets to decode)."""
    count, n = count.astype(np.int64), n.astype(np.int64)
    if len(count) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    guess = np.floor(np.log2(np.maximum(n / np.maximum(count, 1), 1.0))).astype(np.int64)
    best_l = np.zeros(len(count), np.int64)
    best = np.full(len(count), np.iinfo(np.int64).max)
    for delta in (1, 0, -1):
        width = np.clip(guess + delta, 0, _MAX_WIDTH)
        bits = count + ((n - 1) >> width) + 1 + width * ((count + 7) // 8 * 8)
        better = bits < best
        best_l, best = np.where(better, width, best_l), np.where(better, bits, best)
    return best_l, best


def _pack_planes(values: np.ndarray, local: np.ndarray, width: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The low-bit stream of the Elias-Fano rows (``width[r]`` low bits of each of their
    ``count[r]`` indices ``values``; ``local`` each index's slot in its row): plane by plane,
    least significant first, plane ``b`` holding bit ``b`` of every index of the rows wider
    than ``b``, row after row, each row's plane padded to whole bytes."""
    plane_bytes = (count + 7) // 8
    parts = []
    w_elem = np.repeat(width, count)
    for bit in range(int(width.max()) if len(width) else 0):  # a loop over planes, not rows
        has = width > bit
        size = plane_bytes[has] * 8
        bits = np.zeros(int(size.sum()), np.uint8)
        at = np.repeat(np.cumsum(size) - size, count[has]) + local[w_elem > bit]
        bits[at] = (values[w_elem > bit] >> bit) & 1
        parts.append(np.packbits(bits))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


_MIN_CHUNK_SLOTS = 1 << 16
"""Fewest output slots (rows x ``K``) :func:`decode_sets` gives a thread: below that, handing
work to a thread costs more than the thread saves."""

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``threads`` decoding threads (made on first use, then reused)."""
    with _POOLS_LOCK:
        if threads not in _POOLS:
            _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="decode_sets")
        return _POOLS[threads]


def _target(flat: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, bool]:
    """Where rows ``rows`` (ascending int indices into ``flat`` ``[M, K]``) are decoded: a view
    of ``flat`` when they are consecutive (``True``: written in place), else a new block."""
    if len(rows) and int(rows[-1]) - int(rows[0]) + 1 == len(rows):
        return flat[int(rows[0]):int(rows[-1]) + 1], True
    return np.empty((len(rows), flat.shape[1]), flat.dtype), False


def _left_aligned(values: np.ndarray, counts: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``values`` (each row's ``counts[r]`` entries back to back) as ``[R, K]`` with each row's
    entries left-aligned, and the mask of those slots (``None`` when every row is full: then
    the block is a reshape, no copy)."""
    if (counts == k).all():
        return values.reshape(len(counts), k), None
    valid = np.arange(k)[None, :] < counts[:, None]
    block = np.zeros((len(counts), k), values.dtype)
    block[valid] = values
    return block, valid


def _finish(flat, rows, dst, in_place, valid, counts, sizes, what) -> None:
    """Check each decoded row's range (its first index >= 0, its last below its universe),
    write ``-1`` after each row's indices and ``dst`` into ``flat[rows]`` unless in place."""
    if len(counts) and ((dst[:, 0] < 0).any() or (dst[np.arange(len(counts)), counts - 1] >= sizes).any()):
        raise TraceCodecError(f"sets: a {what} index outside its row's universe")
    if valid is not None:
        dst[~valid] = -1
    if not in_place:
        flat[rows] = dst


class SetsHeader(NamedTuple):
    """The checked per-row layout of a sets encoding (:func:`read_sets_header`), numpy arrays:
    ``shape`` the decoded shape ``[N, ..., K]``; ``n`` int64 ``[M]`` each row's universe;
    ``kind`` uint8 ``[M]``; ``count`` int64 ``[M]`` indices per row (0 for empty and 'all'
    rows); ``width`` int64 ``[rows of kind 3]`` their Elias-Fano widths, in row order."""

    shape: tuple[int, ...]
    n: np.ndarray
    kind: np.ndarray
    count: np.ndarray
    width: np.ndarray


def read_sets_header(encoded: Mapping[str, Any], universe: np.ndarray) -> SetsHeader:
    """Check a sets encoding's header and stream sizes against ``universe`` (int ``[N]``) and
    return its per-row layout; shared by :func:`decode_sets` and the torch decoder.

    Raises:
        TraceCodecError: a malformed encoding, named by its part (a shape without a row axis,
            universes of another length, unknown kinds, counts or widths that disagree with the
            kinds or universes, a stream of the wrong size).
    """
    if encoded.get("codec") != "sets":
        raise TraceCodecError(f"sets: unknown codec {encoded.get('codec')!r}")
    shape = _shape(encoded)
    if len(shape) < 2:
        raise TraceCodecError(f"sets: shape {shape} has no row axis")
    n_lead = np.asarray(universe, dtype=np.int64)
    if n_lead.shape != shape[:1]:
        raise TraceCodecError(f"sets: {n_lead.shape[0] if n_lead.ndim else '?'} universes for "
                              f"{shape[0]} rows")
    k = shape[-1]
    m = math.prod(shape[:-1])
    n = np.repeat(n_lead, math.prod(shape[1:-1]))
    kind = _array(encoded, "kind")
    if kind.shape != (m,) or (kind > ELIAS_FANO).any():
        raise TraceCodecError(f"sets: kind {kind.shape} for {m} rows (values 0..3)")
    coded = kind >= BITMAP
    count = _array(encoded, "count").astype(np.int64)
    if count.shape != (int(coded.sum()),) or (count > k).any() or (count == 0).any():
        raise TraceCodecError(f"sets: count {count.shape} for {int(coded.sum())} coded rows of "
                              f"1 to {k}")
    if (count >= n[coded]).any():
        raise TraceCodecError("sets: a coded row's count is not below its universe")
    if (n[kind == ALL] > k).any():
        raise TraceCodecError(f"sets: an 'all' row whose universe exceeds the {k} slots")
    row_count = np.zeros(m, np.int64)
    row_count[coded] = count
    ef = kind == ELIAS_FANO
    width = _array(encoded, "width").astype(np.int64)
    if width.shape != (int(ef.sum()),) or (width > _MAX_WIDTH).any():
        raise TraceCodecError(f"sets: width {width.shape} for {int(ef.sum())} Elias-Fano rows")
    bitmap_bits = int(n[kind == BITMAP].sum())
    high_bits = int((row_count[ef] + ((n[ef] - 1) >> width) + 1).sum())
    low_bytes = int((width * ((row_count[ef] + 7) // 8)).sum())
    for name, want in (("bitmap", (bitmap_bits + 7) // 8), ("high", (high_bits + 7) // 8), ("low", low_bytes)):
        if _array(encoded, name).size != want:
            raise TraceCodecError(f"sets: {name} stream of {_array(encoded, name).size} bytes, "
                                  f"the rows need {want}")
    return SetsHeader(shape, n, kind, row_count, width)


class _Offsets(NamedTuple):
    """Where each flat row's data starts in the streams, int64 ``[M + 1]`` each (entry ``M`` the
    end): ``bitmap`` and ``high`` in bits, ``ef`` the Elias-Fano rows before the row (an index
    into the header's ``width``), ``planes`` ``[P, M + 1]`` bytes into ``low`` per bit plane."""

    bitmap: np.ndarray
    high: np.ndarray
    ef: np.ndarray
    planes: np.ndarray


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    """int64 ``[len(values) + 1]``: 0, then the running sums."""
    out = np.zeros(len(values) + 1, np.int64)
    np.cumsum(values, out=out[1:])
    return out


def _offsets(header: SetsHeader) -> _Offsets:
    """The stream offsets of every row of ``header`` (the layout of the module docstring): one
    running sum per stream, all at once (a chunk's offsets are read at its first and last row)."""
    _, n, kind, count, width = header
    m = len(kind)
    ef = kind == ELIAS_FANO
    w = np.zeros(m, np.int64)
    w[ef] = width
    planes = int(width.max()) if len(width) else 0
    per_row = np.zeros((3 + planes, m), np.int64)  # bitmap bits, high bits, EF rows, plane bytes
    per_row[0] = np.where(kind == BITMAP, n, 0)
    per_row[1] = np.where(ef, count + ((n - 1) >> w) + 1, 0)
    per_row[2] = ef
    per_row[3:] = np.where(ef & (w > np.arange(planes)[:, None]), (count + 7) // 8, 0)
    at = np.zeros((3 + planes, m + 1), np.int64)
    np.cumsum(per_row, axis=1, out=at[:, 1:])
    at[3:] += (np.cumsum(at[3:, -1]) - at[3:, -1])[:, None]  # plane b after planes 0..b-1
    return _Offsets(at[0], at[1], at[2], at[3:])


def _bits(packed: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bits ``start .. stop - 1`` of ``packed`` (uint8, MSB first) as a bool array."""
    first = start >> 3
    return np.unpackbits(packed[first:(stop + 7) >> 3], count=stop - (first << 3))[start & 7:].view(bool)


def decode_sets(encoded: Mapping[str, Any], universe: np.ndarray, dtype: Any = np.int32,
                out: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """Inverse of :func:`encode_sets`: ``[N, ..., K]`` of ``dtype`` (default int32), each row its
    indices ascending then ``-1`` (:func:`canonical_sets` of the array encoded).

    With ``threads > 1`` the rows are split into up to that many chunks of consecutive rows
    (each at least ``_MIN_CHUNK_SLOTS`` output slots), each decoded straight into its slice of
    ``out`` by a process-wide pool of ``threads`` threads (numpy releases the GIL inside its
    loops over arrays). The result does not depend on ``threads``.

    Args:
        encoded: what :func:`encode_sets` returned (e.g. after a trip through the codec).
        universe: int ``[N]``, the same universe sizes as at encoding.
        dtype: the output's signed integer dtype (ignored when ``out`` is given).
        out: optional writable C-contiguous signed integer array of the encoded shape to decode
            into (e.g. a slice of a larger column); a new array when ``None``.
        threads: decoding threads, ``>= 1``.
    Returns:
        ``out``, or a new writable array.
    Raises:
        TraceCodecError: a malformed encoding, named by its part (see :func:`read_sets_header`;
            a decoded index outside its row's universe), an ``out`` of another shape or dtype,
            or ``threads`` below 1. Order within a row is not checked: a corrupted ``low``
            stream may give a row out of order, never an index outside its universe.
    """
    if type(threads) is not int or threads < 1:
        raise TraceCodecError(f"sets: threads must be an int >= 1, got {threads!r}")
    header = read_sets_header(encoded, universe)
    shape = header.shape
    k, m = shape[-1], math.prod(shape[:-1])
    if out is None:
        out = np.empty(shape, dtype=dtype)
    if (not isinstance(out, np.ndarray) or out.shape != shape or out.dtype.kind != "i"
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise TraceCodecError(f"sets: out must be a writable C-contiguous signed int array of "
                              f"shape {shape}")
    flat = out.reshape(m, k)
    offsets = _offsets(header)
    parts = max(1, min(threads, m * k // _MIN_CHUNK_SLOTS))
    step = -(-m // parts) if m else 1
    chunks = [(r, min(r + step, m)) for r in range(0, m, step)]
    if threads == 1 or len(chunks) == 1:
        for r0, r1 in chunks:
            _decode_chunk(encoded, header, offsets, flat, r0, r1)
    else:  # the first error raised by a chunk propagates
        list(_pool(threads).map(lambda c: _decode_chunk(encoded, header, offsets, flat, *c), chunks))
    return out


def _decode_chunk(encoded, header: SetsHeader, offsets: _Offsets, flat: np.ndarray, r0: int, r1: int) -> None:
    """Decode flat rows ``r0 .. r1 - 1`` into ``flat[r0:r1]``, reading only their part of each
    stream (:class:`_Offsets`)."""
    k = flat.shape[1]
    kind, n, count = header.kind[r0:r1], header.n[r0:r1], header.count[r0:r1]
    block = flat[r0:r1]
    if (kind == EMPTY).any():
        block[kind == EMPTY] = -1
    every = np.flatnonzero(kind == ALL)
    if len(every):  # 0..n-1, then -1
        dst, in_place = _target(block, every)
        cols = np.arange(k)
        np.copyto(dst, cols[None, :])
        np.copyto(dst, -1, where=cols[None, :] >= n[every, None])
        if not in_place:
            block[every] = dst
    rows = np.flatnonzero(kind == BITMAP)
    if len(rows):
        bits = _bits(_array(encoded, "bitmap"), int(offsets.bitmap[r0]), int(offsets.bitmap[r1]))
        _decode_bitmap_rows(bits, block, rows, n[rows], count[rows])
    rows = np.flatnonzero(kind == ELIAS_FANO)
    if len(rows):
        high = _bits(_array(encoded, "high"), int(offsets.high[r0]), int(offsets.high[r1]))
        low = _array(encoded, "low")
        planes = [low[int(p[r0]):int(p[r1])] for p in offsets.planes]
        width = header.width[int(offsets.ef[r0]):int(offsets.ef[r1])]
        _decode_elias_fano_rows(high, planes, block, rows, n[rows], count[rows], width)


def _decode_bitmap_rows(bits: np.ndarray, flat: np.ndarray, rows: np.ndarray, sizes: np.ndarray,
                        counts: np.ndarray) -> None:
    """Decode the bitmap rows ``rows`` of ``flat`` (each ``sizes[r]`` bits of ``bits``, back to
    back, ``counts[r]`` ones)."""
    where = np.flatnonzero(bits)
    if len(where) != int(counts.sum()):
        raise TraceCodecError(f"sets: bitmap holds {len(where)} indices, counts say {int(counts.sum())}")
    block, valid = _left_aligned(where, counts, flat.shape[1])
    dst, in_place = _target(flat, rows)
    np.subtract(block, (np.cumsum(sizes) - sizes)[:, None], out=dst, casting="unsafe")
    _finish(flat, rows, dst, in_place, valid, counts, sizes, "bitmap")


def _decode_elias_fano_rows(high: np.ndarray, planes: list[np.ndarray], flat: np.ndarray, rows: np.ndarray,
                            sizes: np.ndarray, counts: np.ndarray, width: np.ndarray) -> None:
    """Decode the Elias-Fano rows ``rows`` of ``flat`` from their high bits ``high`` (bool, the
    rows' back to back) and their bytes of each low plane ``planes``. The ``j``-th index of a
    row is the ``j``-th one of its high bits, at bit ``bucket + j`` of the row: its bucket is
    that position less ``j`` (one broadcast subtraction), so no running sum is needed; then
    ``bucket << width | low``, all over ``[rows, K]`` blocks at once."""
    row_bits = counts + ((sizes - 1) >> width) + 1
    ones = np.flatnonzero(high)
    total = int(counts.sum())
    bit_start = np.cumsum(row_bits) - row_bits
    first = np.cumsum(counts) - counts  # each row's first index, counted over all rows
    if len(ones) != total or (total and (
            (ones[first] < bit_start).any() or (ones[first + counts - 1] >= bit_start + row_bits).any())):
        raise TraceCodecError(f"sets: high stream of {len(ones)} ones for {total} indices, or "
                              f"ones outside their row")
    k = flat.shape[1]
    low = _read_planes(planes, width, counts, k)
    block, valid = _left_aligned(ones, counts, k)
    dst, in_place = _target(flat, rows)
    # one narrowing copy, then every pass in dst's dtype (a subtraction that narrows as it goes
    # takes ~1.2x a copy and a subtraction); numpy runs a per-row operand ([R, 1]) about 3x
    # slower than a scalar, hence the scalar when every row has the same width
    np.copyto(dst, block, casting="unsafe")
    np.subtract(dst, np.arange(k, dtype=dst.dtype), out=dst)  # bit position less j
    np.subtract(dst, bit_start[:, None].astype(dst.dtype), out=dst)  # the bucket
    if len(width) and width.min() == width.max():  # << width (numpy's multiply is faster)
        np.multiply(dst, (1 << width[:1]).astype(dst.dtype)[0], out=dst)  # wraps as the per-row one
    else:
        np.multiply(dst, (1 << width)[:, None].astype(dst.dtype), out=dst)
    np.bitwise_or(dst, low, out=dst)
    _finish(flat, rows, dst, in_place, valid, counts, sizes, "Elias-Fano")


def _read_planes(planes: list[np.ndarray], width: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """The low parts ``[R, K]`` (the smallest unsigned dtype holding ``width.max()`` bits; slots
    past a row's count hold garbage) from the rows' bytes of each plane of the low stream of
    :func:`_pack_planes` (``planes[b]``: plane ``b`` of the rows wider than ``b``), each
    unpacked at once. A loop over planes, not rows."""
    plane_bytes = (counts + 7) // 8
    top = int(width.max()) if len(width) else 0
    dt = np.uint8 if top <= 8 else np.uint16 if top <= 16 else np.uint32
    acc = np.zeros((len(width), k), dt)
    for bit in range(top):
        has = width > bit
        size = plane_bytes[has]
        bits = np.unpackbits(planes[bit])
        if (size * 8 == k).all():
            plane = bits.reshape(len(size), k)
        else:  # rows of other lengths: each row's bits left-aligned
            plane = np.zeros((len(size), (k + 7) // 8 * 8), np.uint8)
            plane[np.arange(plane.shape[1])[None, :] < size[:, None] * 8] = bits
            plane = plane[:, :k]
        if dt is not np.uint8:
            plane = plane.astype(dt)
        if bit:  # a multiply: numpy's shift of small ints by a scalar is ~10x slower
            np.multiply(plane, dt(1 << bit), out=plane)
        if has.all():
            acc |= plane
        else:
            acc[has] |= plane
    return acc


def _shape(encoded: Mapping[str, Any]) -> tuple[int, ...]:
    shape = encoded.get("shape") if isinstance(encoded, Mapping) else None
    if not isinstance(shape, (list, tuple)) or not shape or not all(
            type(d) is int and d >= 0 for d in shape):
        raise TraceCodecError(f"encoded trace: shape must be a list of non-negative ints, got "
                              f"{shape!r}"[:200])
    return tuple(shape)


def _array(encoded: Mapping[str, Any], name: str) -> np.ndarray:
    value = encoded.get(name)
    if not isinstance(value, np.ndarray) or value.ndim < 1 or value.dtype.kind != "u":
        raise TraceCodecError(f"encoded trace: {name!r} must be an unsigned numpy array, got "
                              f"{type(value).__name__}")
    return value
