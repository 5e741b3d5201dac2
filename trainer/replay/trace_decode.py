"""Decoding of indexer key sets (``replayrl.transport.trace_codec``'s ``"sets"`` codec) with torch
ops on a chosen device, e.g. the trainer's GPU, instead of numpy on the host.

:func:`decode_sets_torch` gives what ``replayrl.transport.trace_codec.decode_sets`` gives (each
row's indices ascending, then ``-1``) as a tensor on ``device``: the encoded bytes (a few
hundredths of the int32 array) are copied to the device and unpacked there. The header checks
are the numpy decoder's (``read_sets_header``, on the host); the checks on decoded values run
on the device and are read back once at the end. Tested on CPU against the numpy decoder; it has
not been run on a GPU here (untested there). Nothing calls it yet: the trainer's columns are
decoded by ``replayrl.rollout.traces.trace_storage.decode_column`` (numpy) before collation.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from replayrl.transport.trace_codec import ALL, BITMAP, ELIAS_FANO, TraceCodecError, read_sets_header

__all__ = ["decode_sets_torch"]


def _unpack(packed: np.ndarray, count: int, device: torch.device) -> torch.Tensor:
    """The first ``count`` bits of ``packed`` (uint8, MSB first) as a bool ``[count]`` tensor
    (an AND with each bit's mask: on a CPU torch's shifts are several times slower)."""
    t = torch.from_numpy(np.ascontiguousarray(packed)).to(device)
    masks = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)
    return (t[:, None] & masks).ne(0).reshape(-1)[:count]


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def _exclusive_cumsum(a: np.ndarray) -> np.ndarray:
    return np.cumsum(a) - a


def decode_sets_torch(encoded: Mapping[str, Any], universe: np.ndarray, device: Any = None,
                      dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Inverse of ``encode_sets`` with torch ops on ``device``, over ``[rows, K]`` blocks as the
    numpy decoder does (no per-index ``repeat_interleave`` or gathers: an index is its high
    bit's position less its slot and its row's start, shifted, OR its low bits).

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
    rows = np.flatnonzero(kind == BITMAP)
    if len(rows):
        counts, sizes = row_count[rows], n[rows]
        where = torch.nonzero(_unpack(encoded["bitmap"], int(sizes.sum()), dev)).squeeze(1)
        if where.numel() != int(counts.sum()):
            raise TraceCodecError(f"sets: bitmap holds {where.numel()} indices, counts say {int(counts.sum())}")
        block, valid = _left_aligned(where, counts, k, dev)
        bad |= _place(out, rows, block - _tensor(_exclusive_cumsum(sizes), dev)[:, None], valid, counts, sizes, dev)
    rows = np.flatnonzero(kind == ELIAS_FANO)
    if len(rows):
        block, valid, wrong = _elias_fano_block(encoded, row_count[rows], n[rows], width, k, dev)
        bad |= wrong | _place(out, rows, block, valid, row_count[rows], n[rows], dev)
    if bool(bad):  # the one read-back of the device checks
        raise TraceCodecError("sets: an index outside its row's universe, or high-stream ones "
                              "outside their row")
    return out.reshape(shape)


def _left_aligned(values: torch.Tensor, counts: np.ndarray, k: int,
                  dev: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``values`` (each row's ``counts[r]`` entries back to back) as ``[R, K]``, each row's
    entries left-aligned, and the mask of those slots (``None`` when every row is full: then
    the block is a view, no copy)."""
    if (counts == k).all():
        return values.view(len(counts), k), None
    valid = torch.arange(k, device=dev)[None, :] < _tensor(counts, dev)[:, None]
    block = torch.zeros((len(counts), k), dtype=values.dtype, device=dev)
    block[valid] = values
    return block, valid


def _place(out: torch.Tensor, rows: np.ndarray, block: torch.Tensor, valid: torch.Tensor | None,
           counts: np.ndarray, sizes: np.ndarray, dev: torch.device) -> torch.Tensor:
    """Write ``block`` (int64 ``[R, K]``, ``-1`` after each row's ``counts[r]`` indices) into
    ``out[rows]``; returns a bool tensor: whether a row's first index is negative or its last
    at least its universe ``sizes[r]`` (rows ascending, so that bounds the whole row)."""
    last = block.gather(1, _tensor(counts - 1, dev)[:, None]).squeeze(1)
    wrong = (block[:, 0] < 0).any() | (last >= _tensor(sizes, dev)).any()
    if valid is not None:
        block = block.masked_fill(~valid, -1)
    out[_tensor(rows, dev)] = block.to(out.dtype)
    return wrong


def _elias_fano_block(encoded, counts, sizes, width, k, dev) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The Elias-Fano rows' indices as an int64 ``[R, K]`` block (slots past a row's count hold
    garbage), the mask of the valid slots (``None``: all), and a bool tensor: whether some row's
    high-stream ones fall outside the row."""
    row_bits = counts + ((sizes - 1) >> width) + 1
    ones = torch.nonzero(_unpack(encoded["high"], int(row_bits.sum()), dev)).squeeze(1)
    total = int(counts.sum())
    if ones.numel() != total:
        raise TraceCodecError(f"sets: high stream of {ones.numel()} ones for {total} indices")
    bit_start = _tensor(_exclusive_cumsum(row_bits), dev)
    first = _tensor(_exclusive_cumsum(counts), dev)
    c = _tensor(counts, dev)
    wrong = (ones[first] < bit_start).any() | (ones[first + c - 1] >= bit_start + _tensor(row_bits, dev)).any()
    block, valid = _left_aligned(ones, counts, k, dev)
    bucket = block - torch.arange(k, device=dev)[None, :] - bit_start[:, None]
    low = _read_planes(encoded["low"], width, counts, k, dev)
    # bucket << width | low as a multiply and an add: torch's int64 shift by a tensor is slower on a CPU
    return bucket * _tensor(1 << width, dev)[:, None] + low, valid, wrong


def _read_planes(packed: np.ndarray, width: np.ndarray, counts: np.ndarray, k: int,
                 dev: torch.device) -> torch.Tensor:
    """The low parts, int32 ``[R, K]`` (widths are at most 31 bits; slots past a row's count hold
    garbage), from the low stream: each bit plane is one contiguous slice, unpacked at once. A
    loop over planes, not rows."""
    plane_bytes = (counts + 7) // 8
    acc = torch.zeros((len(width), k), dtype=torch.int32, device=dev)
    offset = 0
    for bit in range(int(width.max()) if len(width) else 0):
        has = width > bit
        size = plane_bytes[has]
        nbytes = int(size.sum())
        bits = _unpack(packed[offset:offset + nbytes], nbytes * 8, dev)
        offset += nbytes
        if (size * 8 == k).all():
            plane = bits.view(len(size), k)
        else:  # rows of other lengths: each row's bits left-aligned
            wide = -(-k // 8) * 8
            plane = torch.zeros((len(size), wide), dtype=torch.bool, device=dev)
            plane[torch.arange(wide, device=dev)[None, :] < _tensor(size * 8, dev)[:, None]] = bits
            plane = plane[:, :k]
        part = plane.to(torch.int32) * (1 << bit)
        if has.all():
            acc |= part
        else:
            acc[_tensor(np.flatnonzero(has), dev)] |= part
    return acc
