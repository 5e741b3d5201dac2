"""Keep freed heap memory in a compute actor's process instead of handing it back to the kernel.

glibc's malloc serves large blocks (above a threshold that grows up to 32 MiB) with their own
``mmap`` and unmaps them when freed, and trims the top of the heap once enough of it is free. A
trainer step or an engine ``generate`` allocates and frees the same large activations every
time, so each step faults those pages in again: at 1m x 64 that was ~16,000-18,000 minor faults
per trainer forward + backward and ~13,000 per engine ``generate`` (``getrusage`` minflt), and
each fault costs more in a virtual machine. With blocks kept on the heap the next step reuses them
without a fault; the peak is unchanged (the same live tensors), only the memory freed between
steps stays resident until the process exits (docs/benchmarks.md, cut (20)).

The opposite, trimming the heap after each step, was tried (cut (19)) and made the next step
slower for the same reason.
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_heap"]

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB from the heap (glibc refuses above its own limit)
_MMAP_THRESHOLD_FALLBACK = 32 << 20  # glibc's largest dynamic threshold, accepted by every version
_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: never trim in practice


def keep_freed_heap() -> bool:
    """Set glibc malloc (``mallopt``) to serve blocks below 1 GiB from the heap and never trim it.

    Call once at the start of a process that allocates and frees large tensors every step (the
    engine and trainer actors). Affects only the calling process, all its threads.

    Returns:
        True when both settings took effect; False where the C library is not glibc (musl,
        macOS: nothing is changed) or refused them. Never raises.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 or mallopt(
        _M_MMAP_THRESHOLD, _MMAP_THRESHOLD_FALLBACK) == 1
    return mmap_ok and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
