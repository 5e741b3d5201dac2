"""How a trace column is stored where it crosses the wire (the column forms of samples and
generations): no larger than what it carries (docs/design/traces.md#trace-arrays).

Each row of ``replayrl.rollout.traces.trace_table.TRACES`` names its ``storage``:

* ``"raw"`` -- the int32 column as it is (``sample_support``);
* ``"ids"`` -- :func:`replayrl.transport.trace_codec.encode_ids`: the smallest unsigned dtype
  holding the largest id (``routed_experts``: uint8 for up to 256 experts), all ``-1`` rows
  listed in a bitmap; decoding restores the very array;
* ``"sets"`` -- :func:`replayrl.transport.trace_codec.encode_sets` with row ``p`` of each item
  (trajectory) drawing its set from the ``p + 1`` key positions its causal query sees
  (``indexer_topk``): a row selecting every key it sees costs no bytes, other rows cost the
  smaller of a bitmap and an Elias-Fano code. Decoding gives each row's keys ascending with
  ``-1`` after: the same set, in canonical order (the model reads a row as a set of keys to
  attend to, the flip rates compare sets). Where the rows hold compressed-entry ids instead of
  key positions (DeepSeek-V4's CSA indexer: entry ``w`` covers tokens ``[m*w, m*(w+1))``, so a
  query at ``p`` sees the ``(p + 1) // m`` entries ``w < (p + 1) // m``), row ``p``'s universe
  is ``(p + 1) // stride``, ``stride`` the largest integer every row of the column (or chunk)
  fits (:func:`entry_stride`: ``m`` for such rows, 1 for causal key rows), written into the
  encoding as ``"stride"``; so a row picking every entry it sees costs no bytes there either,
  and a coded row's bitmap holds ``(p + 1) // m`` bits, not ``p + 1``.

A ``"sets"`` column of more than :data:`CHUNK_SLOTS` slots is encoded in chunks of rows,
``{"codec": "chunks", "rows": [rows per chunk], "parts": [encoding or array per chunk]}``.

Only a concatenated column (every item has the trace with the same trailing shape, a numpy int
array) is encoded; a ``None`` or per-item list column, and any column a codec cannot hold
exactly (e.g. a repeated or non-causal key), travels as it is. The in-memory form is unchanged:
int32 arrays with ``-1`` padding, as ``replayrl.rollout.sample.Sample`` holds them.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from replayrl.transport.trace_codec import (
    TraceCodecError,
    decode_ids,
    decode_sets,
    encode_ids,
    encode_sets,
    encoded_nbytes,
)

__all__ = ["CHUNK_SLOTS", "encode_column", "decode_column", "row_positions", "entry_stride",
           "wire_nbytes"]

CHUNK_SLOTS = 1 << 22
"""A ``"sets"`` column of more slots than this is encoded in chunks of whole rows of at most
this many slots each (at least one row): encoding works on int64 copies of its input, so this
bounds its memory (~32 MiB a copy); a chunk the set codec cannot hold travels as it is."""


def row_positions(counts: Sequence[int]) -> np.ndarray:
    """int64 ``[sum(counts)]``: each row's index within its item (``0..counts[i]-1`` per item),
    i.e. the query position of a position-row trace's row."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


def entry_stride(column: np.ndarray, positions: np.ndarray) -> int:
    """The largest ``s >= 1`` with every index of row ``r`` below ``(positions[r] + 1) // s``.

    Args:
        column: int ``[N, ..., K]`` set rows (``-1`` = empty slot).
        positions: int64 ``[N]``, each leading row's query position ``p``.
    Returns:
        ``min over rows with an index of (p + 1) // (max index + 1)``; 1 when no row has an
        index or when some index is at or past ``p + 1`` (no set of its keys: the codec refuses
        such a column whatever the stride).
    """
    flat = column.reshape(len(column), math.prod(column.shape[1:]))
    top = flat.max(axis=1, initial=-1).astype(np.int64)  # each row's largest index, -1 if none
    used = top >= 0
    if not used.any():
        return 1
    return max(1, int(((positions[used] + 1) // (top[used] + 1)).min()))


def _universe(positions: np.ndarray, stride: int) -> np.ndarray:
    """int64 ``[N]``: the entries a query at each position sees, ``(p + 1) // stride``."""
    return (positions + 1) // stride


def _encode_sets(column: np.ndarray, positions: np.ndarray) -> dict | None:
    """:func:`encode_sets` of ``column`` over the universes ``(p + 1) // stride``, with
    ``"stride"`` in the encoding; ``None`` where the codec cannot hold it."""
    stride = entry_stride(column, positions)
    encoded = encode_sets(column, _universe(positions, stride))
    if encoded is not None:
        encoded["stride"] = stride
    return encoded


def _stride_of(part: Mapping[str, Any]) -> int:
    """A sets encoding's ``"stride"`` (1 when absent), checked."""
    stride = part.get("stride", 1)
    if type(stride) is not int or stride < 1:
        raise TraceCodecError(f"sets: stride must be an int >= 1, got {stride!r}"[:200])
    return stride


def encode_column(row: Any, column: Any, counts: Sequence[int]) -> Any:
    """The wire form of trace column ``column`` (a ``replayrl.rollout.sample.pack_rows`` result).

    Args:
        row: the trace's ``TraceSpec``.
        column: ``None``, a list of per-item arrays, or the items' rows concatenated.
        counts: rows per item (``rows_in`` of each item), used by ``"sets"`` storage.
    Returns:
        an encoded mapping (``replayrl.transport.trace_codec``) for a concatenated int column
        whose storage is not ``"raw"`` and which the codec holds exactly; else ``column``.
    """
    if row.storage == "raw" or not isinstance(column, np.ndarray) or column.dtype.kind not in "iu":
        return column
    if row.storage == "ids":
        return encode_ids(column) if column.size == 0 or int(column.min()) >= -1 else column
    if column.ndim < 2:
        return column
    positions = row_positions(counts)
    per_row = max(1, math.prod(column.shape[1:]))
    step = max(1, CHUNK_SLOTS // per_row)
    if len(column) <= step:
        encoded = _encode_sets(column, positions)
        return column if encoded is None else encoded
    parts = []
    for start in range(0, len(column), step):  # a loop over chunks of rows, bounding memory
        part = column[start:start + step]
        encoded = _encode_sets(part, positions[start:start + step])
        parts.append(part if encoded is None else encoded)
    return {"codec": "chunks", "rows": [len(p) if isinstance(p, np.ndarray) else p["shape"][0]
                                        for p in parts], "parts": parts}


def wire_nbytes(column: Any) -> int:
    """Bytes of the arrays a trace column's wire form holds (an :func:`encode_column` result,
    as sent or as received): an encoded mapping's arrays (each chunk's, for ``"chunks"``), a
    plain array's ``nbytes``, a per-item list's arrays summed, 0 for ``None``. The few msgpack
    bytes of keys, shapes and strides are not counted
    (``replayrl.transport.trace_codec.encoded_nbytes``).

    Raises:
        TraceCodecError: a column that is none of these forms (the message names its type).
    """
    if column is None:
        return 0
    if isinstance(column, np.ndarray):
        return int(column.nbytes)
    if isinstance(column, Mapping):
        if column.get("codec") == "chunks":
            return sum(wire_nbytes(part) for part in column.get("parts", ()))
        return encoded_nbytes(column)
    if isinstance(column, (list, tuple)):
        return sum(wire_nbytes(item) for item in column)
    raise TraceCodecError(f"a trace column of type {type(column).__name__} is no wire form")


def decode_column(row: Any, column: Any, counts: Sequence[int], threads: int = 1) -> Any:
    """Inverse of :func:`encode_column`: a read-only array of ``row.dtype`` for an encoded
    mapping; anything else unchanged. ``threads`` (``>= 1``) threads decode a ``"sets"``
    column's rows (``replayrl.transport.trace_codec.decode_sets``; the result is the same).

    Raises:
        ValueError: a malformed encoding (a ``TraceCodecError``, whose message names the part)
            or ``threads`` below 1; callers name the column.
    """
    if not isinstance(column, Mapping):
        return column
    codec = column.get("codec")
    if codec in ("ids", "ids+1") and row.storage == "ids":
        out = decode_ids(column, row.dtype)
    elif codec == "sets" and row.storage == "sets":
        _check_rows(column.get("shape"), counts)
        out = decode_sets(column, _universe(row_positions(counts), _stride_of(column)), row.dtype,
                          threads=threads)
    elif codec == "chunks" and row.storage == "sets":
        out = _decode_chunks(row, column, counts, threads)
    else:
        raise TraceCodecError(f"codec {codec!r} is not the trace's storage {row.storage!r}"[:300])
    out.flags.writeable = False
    return out


def _check_rows(shape: Any, counts: Sequence[int]) -> None:
    total = int(np.sum(counts, dtype=np.int64))
    if not isinstance(shape, (list, tuple)) or not shape or shape[0] != total:
        raise TraceCodecError(f"encoded shape {shape!r} does not hold the {total} rows the "
                              f"lengths give"[:300])


def _decode_chunks(row: Any, column: Mapping[str, Any], counts: Sequence[int], threads: int = 1) -> np.ndarray:
    """The rows of a chunked ``"sets"`` column, each chunk decoded straight into its slice of one
    preallocated output (a loop over chunks, each vectorised, on ``threads`` threads)."""
    rows, parts = column.get("rows"), column.get("parts")
    if (not isinstance(rows, list) or not isinstance(parts, list) or len(rows) != len(parts)
            or not parts or not all(type(r) is int and r > 0 for r in rows)):
        raise TraceCodecError("chunks: expected as many positive 'rows' as 'parts'")
    positions = row_positions(counts)
    _check_rows([sum(rows)], counts)
    first = parts[0]
    tail = first.shape[1:] if isinstance(first, np.ndarray) else tuple(_shape_of(first)[1:])
    out = np.empty((len(positions), *tail), dtype=row.dtype)
    start = 0
    for n, part in zip(rows, parts):
        if isinstance(part, np.ndarray):
            if part.shape != (n, *tail):
                raise TraceCodecError(f"chunks: part of shape {part.shape} at row {start}, expected "
                                      f"{(n, *tail)}")
            out[start:start + n] = part
        elif isinstance(part, Mapping) and part.get("codec") == "sets":
            if tuple(_shape_of(part)) != (n, *tail):
                raise TraceCodecError(f"chunks: part of shape {_shape_of(part)} at row {start}, "
                                      f"expected {(n, *tail)}")
            decode_sets(part, _universe(positions[start:start + n], _stride_of(part)),
                        out=out[start:start + n], threads=threads)  # in place
        else:
            raise TraceCodecError(f"chunks: a part that is no array and no sets encoding at row {start}")
        start += n
    return out


def _shape_of(part: Mapping[str, Any]) -> list:
    shape = part.get("shape")
    if not isinstance(shape, (list, tuple)) or not shape:
        raise TraceCodecError(f"chunks: a part without a shape: {shape!r}"[:200])
    return list(shape)
