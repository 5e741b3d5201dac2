"""How a trace column is stored where it crosses the wire (the column forms of samples and
generations): no larger than what it carries (docs/design.md#trace-arrays).

Each row of ``replayrl.rollout.trace_table.TRACES`` names its ``storage``:

* ``"raw"`` -- the int32 column as it is (``sample_support``);
* ``"ids"`` -- :func:`replayrl.transport.trace_codec.encode_ids`: the smallest unsigned dtype
  holding the largest id (``routed_experts``: uint8 for up to 256 experts), all ``-1`` rows
  listed in a bitmap; decoding restores the very array;
* ``"sets"`` -- :func:`replayrl.transport.trace_codec.encode_sets` with row ``p`` of each item
  (trajectory) drawing its set from the ``p + 1`` key positions its causal query sees
  (``indexer_topk``): a row selecting every key it sees costs no bytes, other rows cost the
  smaller of a bitmap and Rice-coded deltas. Decoding gives each row's keys ascending with
  ``-1`` after: the same set, in canonical order (the model reads a row as a set of keys to
  attend to, the flip rates compare sets).

Only a concatenated column (every item has the trace with the same trailing shape, a numpy int
array) is encoded; a ``None`` or per-item list column, and any column a codec cannot hold
exactly (e.g. a repeated or non-causal key), travels as it is. The in-memory form is unchanged:
int32 arrays with ``-1`` padding, as ``replayrl.rollout.sample.Sample`` holds them.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from replayrl.transport.trace_codec import TraceCodecError, decode_ids, decode_sets, encode_ids, encode_sets

__all__ = ["encode_column", "decode_column", "row_positions"]


def row_positions(counts: Sequence[int]) -> np.ndarray:
    """int64 ``[sum(counts)]``: each row's index within its item (``0..counts[i]-1`` per item),
    i.e. the query position of a position-row trace's row."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


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
    encoded = encode_sets(column, row_positions(counts) + 1)
    return column if encoded is None else encoded


def decode_column(row: Any, column: Any, counts: Sequence[int]) -> Any:
    """Inverse of :func:`encode_column`: a read-only array of ``row.dtype`` for an encoded
    mapping; anything else unchanged.

    Raises:
        ValueError: a malformed encoding (a ``TraceCodecError``, whose message names the part);
            callers name the column.
    """
    if not isinstance(column, Mapping):
        return column
    codec = column.get("codec")
    if codec in ("ids", "ids+1") and row.storage == "ids":
        out = decode_ids(column, row.dtype)
    elif codec == "sets" and row.storage == "sets":
        total = int(np.sum(counts, dtype=np.int64))
        shape = column.get("shape")
        if not isinstance(shape, (list, tuple)) or not shape or shape[0] != total:
            raise TraceCodecError(f"encoded shape {shape!r} does not hold the {total} rows the "
                                  f"lengths give"[:300])
        out = decode_sets(column, row_positions(counts) + 1, row.dtype)
    else:
        raise TraceCodecError(f"codec {codec!r} is not the trace's storage {row.storage!r}"[:300])
    out.flags.writeable = False
    return out
