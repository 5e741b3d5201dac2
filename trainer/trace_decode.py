"""Decoding of indexer key sets (``replayrl.transport.trace_codec``'s ``"sets"`` codec) with torch
ops on a chosen device, e.g. the trainer's GPU, instead of numpy on the host.

:func:`decode_sets_torch` gives what ``replayrl.transport.trace_codec.decode_sets`` gives (each
row's indices ascending, then ``-1``) as a tensor on ``device``: the encoded bytes (a few
hundredths of the int32 array) are copied to the device and unpacked there. The header checks
are the numpy decoder's (``read_sets_header``, on the host); the checks on decoded values run
on the device and are read back once at the end. Tested on CPU against the numpy decoder; it has
not been run on a GPU here (untested there). Nothing calls it yet: the trainer's columns are
decoded by ``replayrl.rollout.trace_storage.decode_column`` (numpy) before collation.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from replayrl.transport.trace_codec import ALL, BITMAP, ELIAS_FANO, TraceCodecError, read_sets_header

__all__ = ["decode_sets_torch"]


def _unpack(packed: np.ndarray, count: int, device: torch.device) -> torch.Tensor:
    """The first ``count`` bits of ``packed`` (uint8, MSB first) as a bool ``[count]`` tensor."""
    t = torch.from_numpy(np.ascontiguousarray(packed)).to(device)
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)
    return ((t[:, None] >> shifts) & 1).reshape(-1)[:count].bool()


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def decode_sets_torch(encoded: Mapping[str, Any], universe: np.ndarray, device: Any = None,
                      dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Inverse of ``encode_sets`` with torch ops on ``device``.

    Args:
        encoded: a ``"sets"`` encoding (numpy arrays, as received).
        universe: int ``[N]`` (numpy), each leading row's universe size, as at encoding.
        device: where to decode (``None``: CPU).
        dtype: a signed torch integer dtype for the result.
    Returns:
        ``[N, ..., K]`` tensor of ``dtype`` on ``device``: each row's indices ascending, then ``-1``.
    Raises:
        TraceCodecError: a malformed encoding (``read_sets_header``'s checks; a high or bitmap
            stream whose ones disagree with the counts; a decoded index outside its universe).
    """
    shape, n, kind, row_count, width = read_sets_header(encoded, universe)
    dev = torch.device("cpu") if device is None else torch.device(device)
    k, m = shape[-1], math.prod(shape[:-1])
    out = torch.full((m, k), -1, dtype=dtype, device=dev)  # empty rows stay -1
    cols = torch.arange(k, device=dev)
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    every = np.flatnonzero(kind == ALL)
    if len(every):
        size = _tensor(n[every], dev)[:, None]
        out[_tensor(every, dev)] = torch.where(cols[None, :] < size, cols[None, :], -1).to(dtype)
    for code in (BITMAP, ELIAS_FANO):
        rows = np.flatnonzero(kind == code)
        if not len(rows):
            continue
        counts, sizes = row_count[rows], n[rows]
        if code == BITMAP:
            values = _bitmap_values(encoded, counts, sizes, dev)
        else:
            values, wrong = _elias_fano_values(encoded, counts, sizes, width, dev)
            bad |= wrong
        c, s = _tensor(counts, dev), _tensor(sizes, dev)
        last = torch.cumsum(c, 0) - 1
        bad |= (values[last - c + 1] < 0).any() | (values[last] >= s).any()
        block = torch.full((len(rows), k), -1, dtype=dtype, device=dev)
        block[cols[None, :] < c[:, None]] = values.to(dtype)
        out[_tensor(rows, dev)] = block
    if bool(bad):  # the one read-back of the device checks
        raise TraceCodecError("sets: an index outside its row's universe, or high-stream ones "
                              "outside their row")
    return out.reshape(shape)


def _bitmap_values(encoded, counts, sizes, dev) -> torch.Tensor:
    """The bitmap rows' indices, rows back to back (int64 on ``dev``)."""
    where = torch.nonzero(_unpack(encoded["bitmap"], int(sizes.sum()), dev)).squeeze(1)
    if where.numel() != int(counts.sum()):
        raise TraceCodecError(f"sets: bitmap holds {where.numel()} indices, counts say {int(counts.sum())}")
    starts = _tensor(np.cumsum(sizes) - sizes, dev)
    return where - torch.repeat_interleave(starts, _tensor(counts, dev))


def _elias_fano_values(encoded, counts, sizes, width, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The Elias-Fano rows' indices, rows back to back (int64 on ``dev``), and a bool tensor:
    whether some row's high-stream ones fall outside the row."""
    row_bits = counts + ((sizes - 1) >> width) + 1
    ones = torch.nonzero(_unpack(encoded["high"], int(row_bits.sum()), dev)).squeeze(1)
    total = int(counts.sum())
    if ones.numel() != total:
        raise TraceCodecError(f"sets: high stream of {ones.numel()} ones for {total} indices")
    c, w = _tensor(counts, dev), _tensor(width, dev)
    bit_start = _tensor(np.cumsum(row_bits) - row_bits, dev)
    first = torch.cumsum(c, 0) - c
    wrong = (ones[first] < bit_start).any() | (ones[first + c - 1] >= bit_start + _tensor(row_bits, dev)).any()
    local = torch.arange(total, device=dev) - torch.repeat_interleave(first, c)
    bucket = ones - local - torch.repeat_interleave(bit_start, c)
    w_elem = torch.repeat_interleave(w, c)
    low = torch.zeros(total, dtype=torch.int64, device=dev)
    plane_bytes = (counts + 7) // 8
    packed, offset = encoded["low"], 0
    for bit in range(int(width.max())):  # a loop over planes, not rows
        has = width > bit
        size = plane_bytes[has] * 8
        bits = _unpack(packed[offset:offset + int(size.sum()) // 8], int(size.sum()), dev).long()
        offset += int(size.sum()) // 8
        sel = w_elem > bit
        at = torch.repeat_interleave(_tensor(np.cumsum(size) - size, dev), _tensor(counts[has], dev)) + local[sel]
        low[sel] |= bits[at] << bit
    return (bucket << w_elem) | low, wrong
