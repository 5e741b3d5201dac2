"""Many named arrays as one buffer per dtype: what a weight push sends.

A model's weights are a hundred or more arrays; sent one frame each, the per-frame cost of
ZeroMQ's zero-copy path (tracking each buffer until the I/O thread releases it) dominated a
push of the embedded model (~96 frames for 3.7 MB). :func:`pack_arrays` copies them into one
contiguous array per dtype, which the codec sends as one out-of-band frame each;
:func:`unpack_arrays` gives read-only views into the received buffers, without copying.

Bundle layout (plain msgpack-able data plus numpy arrays)::

    {"buffers": [1-D array per dtype, ...],
     "entries": [[name, buffer index, offset in elements, [shape...]], ...]}
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from replayrl.transport.errors import DecodeError

__all__ = ["bundle_of_buffer", "pack_arrays", "unpack_arrays"]


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Pack ``arrays`` into one contiguous 1-D array per dtype (a copy of every array).

    Args:
        arrays: name -> numpy array of any shape and dtype (names unique by construction).
    Returns:
        the bundle described in the module docstring; entries in ``arrays`` order.
    Raises:
        TypeError: a value is not a numpy array.
    """
    by_dtype: dict[np.dtype, list[np.ndarray]] = {}
    sizes: dict[np.dtype, int] = {}  # elements packed so far per dtype: the next offset
    entries = []
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray):
            raise TypeError(f"pack_arrays: {name!r} is a {type(a).__name__}, not a numpy array")
        parts = by_dtype.setdefault(a.dtype, [])
        index = list(by_dtype).index(a.dtype)
        offset = sizes.get(a.dtype, 0)
        sizes[a.dtype] = offset + a.size
        parts.append(a.reshape(-1))
        entries.append([name, index, offset, list(a.shape)])
    buffers = [np.concatenate(parts) for parts in by_dtype.values()]
    return {"buffers": buffers, "entries": entries}


def bundle_of_buffer(buffer: np.ndarray, layout: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """The bundle of arrays that a caller already concatenated, in ``layout`` order, into one
    1-D ``buffer`` (no copy here; what :func:`pack_arrays` gives for arrays of one dtype).

    Args:
        buffer: 1-D numpy array holding every array's elements back to back.
        layout: ``(name, shape)`` per array, in buffer order; names unique.
    Raises:
        ValueError: ``buffer`` is not 1-D or its size is not the sum of the shapes' sizes.
    """
    entries, offset = [], 0
    for name, shape in layout:
        entries.append([name, 0, offset, [int(d) for d in shape]])
        offset += math.prod(shape)
    if buffer.ndim != 1 or buffer.size != offset:
        raise ValueError(f"bundle_of_buffer: buffer of shape {buffer.shape} for a layout of "
                         f"{offset} elements")
    return {"buffers": [buffer], "entries": entries}


def unpack_arrays(bundle: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_arrays`: name -> read-only view into the bundle's buffers.

    Raises:
        DecodeError: a malformed bundle, naming the entry: not a mapping with ``buffers`` and
            ``entries``, a buffer that is not a 1-D numpy array, an entry that is not
            ``[str, int, int, [int, ...]]``, a repeated name, a buffer index out of range, or
            an offset / shape that reaches outside its buffer.
    """
    if not isinstance(bundle, Mapping) or set(bundle) != {"buffers", "entries"}:
        raise DecodeError(f"array bundle: expected a mapping with 'buffers' and 'entries', got "
                          f"{sorted(bundle) if isinstance(bundle, Mapping) else type(bundle).__name__}")
    buffers, entries = bundle["buffers"], bundle["entries"]
    if not isinstance(buffers, (list, tuple)) or not all(
            isinstance(b, np.ndarray) and b.ndim == 1 for b in buffers):
        raise DecodeError("array bundle: 'buffers' must be a list of 1-D numpy arrays")
    if not isinstance(entries, (list, tuple)):
        raise DecodeError("array bundle: 'entries' must be a list")
    out: dict[str, np.ndarray] = {}
    for i, entry in enumerate(entries):
        ok = (isinstance(entry, (list, tuple)) and len(entry) == 4 and isinstance(entry[0], str)
              and all(type(v) is int for v in entry[1:3])
              and isinstance(entry[3], (list, tuple)) and all(type(d) is int and d >= 0 for d in entry[3]))
        if not ok:
            raise DecodeError(f"array bundle: entry {i} must be [name, buffer, offset, shape], "
                              f"got {entry!r}"[:300])
        name, index, offset, shape = entry
        if name in out:
            raise DecodeError(f"array bundle: entry {i} repeats the name {name!r}")
        if not 0 <= index < len(buffers):
            raise DecodeError(f"array bundle: {name!r}: buffer {index} of {len(buffers)}")
        size = math.prod(shape)
        if offset < 0 or offset + size > buffers[index].size:
            raise DecodeError(f"array bundle: {name!r}: elements [{offset}, {offset + size}) "
                              f"outside its buffer of {buffers[index].size}")
        view = buffers[index][offset:offset + size].reshape(shape)
        view.flags.writeable = False
        out[name] = view
    return out
