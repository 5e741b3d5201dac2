"""Compact, exact storage of int trace arrays: narrow ids and sorted index sets (numpy only).

Two codecs for ``[rows, ..., K]`` int arrays whose ``-1`` means "nothing here", each a plain
mapping of small numpy arrays the transport codec sends out of band
(docs/design.md#trace-arrays):

* :func:`encode_ids` / :func:`decode_ids` -- ids from a small alphabet (e.g. expert ids): the
  values in the smallest unsigned dtype that holds the largest one (uint8 up to 255, so up to
  256 experts), rows that are all ``-1`` listed in a bitmap and not stored; if some row mixes
  ``-1`` with ids, every value is stored ``+ 1`` instead. Decoding gives back the very array
  (same values, same order).
* :func:`encode_sets` / :func:`decode_sets` -- each row a SET of distinct indices into its own
  universe ``[0, n_r)`` (e.g. the keys a causal query at position ``p`` may see, ``n_r = p + 1``).
  A row stores as one of: *empty* (all ``-1``, no payload), *all* (every index of the universe,
  possible when ``n_r <= K``; no payload: it is implied by ``n_r``), a *bitmap* of ``n_r`` bits,
  or *Rice-coded deltas*: the gaps ``d_j = s_j - s_{j-1} - 1`` of the sorted indices (``s_{-1} =
  -1``) as ``d >> l`` in unary and the low ``l`` bits plain, ``l`` chosen per row. The smaller of
  bitmap and deltas is kept. Decoding gives the set in canonical order: ascending, ``-1`` after.
  Order within a row is not carried (a row is a set: the readers of such traces build masks or
  compare sets); everything else is exact.

Decoding is vectorised over all rows at once (no Python loop per row): bit streams are
unpacked with ``np.unpackbits`` and read with ``np.flatnonzero`` / cumulative sums.

Bits are packed MSB first (``np.packbits``), rows back to back with no padding between them.
Set-codec layout (``M`` = number of rows, i.e. the product of every axis but the last)::

    {"codec": "sets", "shape": [..., K], "kind": uint8 [M] (0 empty, 1 all, 2 bitmap,
     3 deltas), "count": uint16|uint32 [rows of kind 2 and 3], "rice": uint8 [rows of kind 3],
     "bitmap": uint8 [...], "unary": uint8 [...], "low": uint8 [...]}

Ids layout: ``{"codec": "ids", "shape": [...], "pad_rows": uint8 packed bits [M], "values":
uintX [M - padded, K]}`` or ``{"codec": "ids+1", "shape": [...], "values": uintX [...]}``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from replayrl.transport.errors import TraceCodecError

__all__ = ["EMPTY", "ALL", "BITMAP", "DELTAS", "TraceCodecError", "canonical_sets",
           "encode_ids", "decode_ids", "encode_sets", "decode_sets", "encoded_nbytes"]

EMPTY, ALL, BITMAP, DELTAS = 0, 1, 2, 3
"""Row kinds of the set codec."""

_MAX_RICE = 31
"""Largest Rice parameter (low bits per index); universes below 2**31 never need more."""


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
    prev = np.concatenate([np.full((len(srt), 1), -1), srt[:, :-1]], axis=1)
    gaps = np.where(valid, srt - prev - 1, 0)
    kind = np.where(count == 0, EMPTY, np.where(count == n, ALL, BITMAP)).astype(np.uint8)
    coded = kind == BITMAP
    rice, rice_bits = _best_rice(gaps[coded], count[coded])
    use_deltas = np.zeros(len(kind), bool)
    use_deltas[coded] = rice_bits + 8 < n[coded]  # + the row's parameter byte
    kind[use_deltas] = DELTAS
    bm_rows = kind == BITMAP
    # bitmap stream: each bitmap row's n bits, back to back
    starts = np.cumsum(n[bm_rows]) - n[bm_rows]
    bits = np.zeros(int(n[bm_rows].sum()), np.uint8)
    bits[(starts[:, None] + srt[bm_rows])[valid[bm_rows]]] = 1
    # delta rows: unary high parts and plain low bits, element by element
    d_rows = kind == DELTAS
    l_row = rice[use_deltas[coded]]
    # streams hold the delta rows grouped by Rice parameter (stable: row order within a group)
    order = np.argsort(l_row, kind="stable")
    d_gaps = gaps[d_rows][order][valid[d_rows][order]]
    d_l = np.repeat(l_row[order].astype(np.int64), count[d_rows][order])
    q = d_gaps >> d_l
    unary = np.zeros(int((q + 1).sum()), np.uint8)
    unary[np.cumsum(q + 1) - 1] = 1
    low = _pack_groups(d_gaps & ((np.int64(1) << d_l) - 1), d_l)
    count_dtype = np.uint16 if k <= np.iinfo(np.uint16).max else np.uint32
    return {"codec": "sets", "shape": [int(d) for d in a.shape], "kind": kind,
            "count": count[kind >= BITMAP].astype(count_dtype), "rice": l_row.astype(np.uint8),
            "bitmap": np.packbits(bits), "unary": np.packbits(unary), "low": low}


def _best_rice(gaps: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row the Rice parameter ``l`` minimising the coded bits ``count * (l + 1) + sum(gaps
    >> l)``, and those bits; tries the four parameters around ``log2`` of the mean gap."""
    if len(gaps) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    mean = gaps.sum(axis=1) / np.maximum(count, 1)
    guess = np.floor(np.log2(np.maximum(mean, 1.0))).astype(np.int64)
    best_l = np.zeros(len(gaps), np.int64)
    best = np.full(len(gaps), np.iinfo(np.int64).max)
    for delta in (-2, -1, 0, 1):
        width = np.clip(guess + delta, 0, _MAX_RICE)
        bits = count * (width + 1) + (gaps >> width[:, None]).sum(axis=1)
        better = bits < best
        best_l, best = np.where(better, width, best_l), np.where(better, bits, best)
    return best_l, best


def _pack_groups(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The low-bit stream: for each distinct width ``w`` ascending, the values of that width
    (contiguous, as the delta rows are grouped by width) in ``w`` bits each, MSB first, packed
    and byte-aligned per group."""
    parts = []
    for w in np.unique(widths).tolist():
        if w == 0:
            continue
        v = values[widths == w]
        bits = (v[:, None] >> np.arange(w - 1, -1, -1)) & 1
        parts.append(np.packbits(bits.astype(np.uint8).reshape(-1)))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def _read_group(packed: np.ndarray, m: int, w: int) -> np.ndarray:
    """``m`` values of ``w`` bits (1..32) from ``packed`` (one group of :func:`_pack_groups`):
    int64. Up to 8 bits, every 8 values fill ``w`` whole bytes: each such block is read as
    one integer and its 8 values shifted out; wider values are right-aligned into big-endian
    2- or 4-byte words."""
    if w <= 8:
        blocks = -(-m // 8)
        raw = np.zeros(blocks * w, np.uint8)
        raw[:packed.size] = packed
        raw = raw.reshape(blocks, w).astype(np.uint64)
        acc = np.zeros(blocks, np.uint64)
        for j in range(w):
            acc = (acc << np.uint64(8)) | raw[:, j]
        out = np.empty((blocks, 8), np.int64)
        mask = np.uint64((1 << w) - 1)
        for j in range(8):
            out[:, j] = (acc >> np.uint64(w * (7 - j))) & mask
        return out.reshape(-1)[:m]
    size = 8 if w <= 8 else 16 if w <= 16 else 32
    bits = np.zeros((m, size), np.uint8)
    bits[:, size - w:] = np.unpackbits(packed, count=m * w).reshape(m, w)
    words = np.packbits(bits, axis=1)
    return words.view(f">u{size // 8}").reshape(m).astype(np.int64)


def _fill_rows(out: np.ndarray, rows: np.ndarray, counts: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` (each row's indices back to back, in the order of ``rows``) left-aligned
    into the rows ``rows`` (int indices) of ``out``: a boolean-mask assignment fills in
    row-major order."""
    block = np.full((len(counts), out.shape[1]), -1, dtype=out.dtype)
    block[np.arange(out.shape[1])[None, :] < counts[:, None]] = values
    out[rows] = block


def decode_sets(encoded: Mapping[str, Any], universe: np.ndarray, dtype: Any = np.int32) -> np.ndarray:
    """Inverse of :func:`encode_sets`: ``[N, ..., K]`` of ``dtype`` (default int32), each row its
    indices ascending then ``-1`` (:func:`canonical_sets` of the array encoded); new, writable.

    Args:
        encoded: what :func:`encode_sets` returned (e.g. after a trip through the codec).
        universe: int ``[N]``, the same universe sizes as at encoding.
    Raises:
        TraceCodecError: a malformed encoding, named by its part (sizes that disagree with the
            kinds, counts or universes; a decoded index outside its row's universe).
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
    if kind.shape != (m,) or (kind > DELTAS).any():
        raise TraceCodecError(f"sets: kind {kind.shape} for {m} rows (values 0..3)")
    out = np.full((m, k), -1, dtype=dtype)
    cols = np.arange(k)
    every = kind == ALL
    if (n[every] > k).any():
        raise TraceCodecError(f"sets: an 'all' row whose universe exceeds the {k} slots")
    out[every] = np.where(cols[None, :] < n[every, None], cols[None, :], -1)
    coded = kind >= BITMAP
    count = _array(encoded, "count").astype(np.int64)
    if count.shape != (int(coded.sum()),) or (count > k).any():
        raise TraceCodecError(f"sets: count {count.shape} for {int(coded.sum())} coded rows of "
                              f"at most {k}")
    row_count = np.zeros(m, np.int64)
    row_count[coded] = count
    _decode_bitmap_rows(encoded, out, kind == BITMAP, n, row_count)
    _decode_delta_rows(encoded, out, kind == DELTAS, n, row_count)
    return out.reshape(shape)


def _decode_bitmap_rows(encoded, out, rows, n, row_count) -> None:
    """Fill ``out[rows]`` from the bitmap stream (each row ``n`` bits, ``row_count`` ones)."""
    sizes, counts = n[rows], row_count[rows]
    total = int(sizes.sum())
    packed = _array(encoded, "bitmap")
    if packed.size != (total + 7) // 8:
        raise TraceCodecError(f"sets: bitmap of {packed.size} bytes for {total} bits")
    where = np.flatnonzero(np.unpackbits(packed, count=total).view(bool))
    if len(where) != int(counts.sum()):
        raise TraceCodecError(f"sets: bitmap holds {len(where)} indices, counts say {int(counts.sum())}")
    starts = np.cumsum(sizes) - sizes
    values = where - np.repeat(starts, counts)
    _check_rows(values, counts, sizes, "bitmap")
    _fill_rows(out, np.flatnonzero(rows), counts, values)


def _decode_delta_rows(encoded, out, rows, n, row_count) -> None:
    """Fill ``out[rows]`` from the unary and low-bit streams of Rice-coded gaps."""
    counts = row_count[rows]
    rice = _array(encoded, "rice").astype(np.int64)
    if rice.shape != counts.shape or (rice > _MAX_RICE).any():
        raise TraceCodecError(f"sets: rice {rice.shape} for {len(counts)} delta rows")
    unary = _array(encoded, "unary")
    ones = np.flatnonzero(np.unpackbits(unary).view(bool))
    total = int(counts.sum())
    if len(ones) != total or unary.size != (int(ones[-1]) // 8 + 1 if total else 0):
        raise TraceCodecError(f"sets: unary stream of {len(ones)} codes for {total} indices")
    order = np.argsort(rice, kind="stable")  # the streams' row order: grouped by parameter
    rice, counts, sizes = rice[order], counts[order], n[rows][order]
    gaps = np.diff(ones, prepend=-1) - 1  # the high parts, then whole gaps
    low = _array(encoded, "low")
    ends = np.cumsum(counts)
    offset = 0
    for w in np.unique(rice).tolist():
        first, last = np.searchsorted(rice, [w, w + 1])
        a = int(ends[first] - counts[first])
        b = int(ends[last - 1])
        m, size = b - a, ((b - a) * w + 7) // 8
        if w == 0:
            continue
        if offset + size > low.size:
            raise TraceCodecError(f"sets: low stream of {low.size} bytes is too short")
        gaps[a:b] = (gaps[a:b] << w) | _read_group(low[offset:offset + size], m, w)
        offset += size
    if offset != low.size:
        raise TraceCodecError(f"sets: low stream of {low.size} bytes for {offset}")
    steps = np.cumsum(gaps + 1)
    before = np.concatenate([[0], steps])[ends - counts]  # per row
    values = steps - np.repeat(before, counts) - 1
    _check_rows(values, counts, sizes, "delta-coded")
    _fill_rows(out, np.flatnonzero(rows)[order], counts, values)


def _check_rows(values: np.ndarray, counts: np.ndarray, sizes: np.ndarray, what: str) -> None:
    """Each row's indices (ascending, back to back) lie in ``[0, size)``: its first is >= 0 and
    its last below its size."""
    has = counts > 0
    last = np.cumsum(counts)[has] - 1
    if len(last) and ((values[last - counts[has] + 1] < 0).any() or (values[last] >= sizes[has]).any()):
        raise TraceCodecError(f"sets: a {what} index outside its row's universe")


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
