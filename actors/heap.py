"""Keep freed heap memory in a compute actor's process once its steps fault large blocks in again.

glibc's malloc serves large blocks (above a threshold that grows up to 32 MiB) with their own
``mmap`` and unmaps them when freed, and trims the top of the heap once enough of it is free. A
trainer step or an engine ``generate`` allocates and frees the same large activations every
time, so each step faults those pages in again: at 1m x 64 that was ~16,000-18,000 minor faults
per trainer forward + backward and ~13,000 per engine ``generate`` (``getrusage`` minflt), and
each fault costs more in a virtual machine. With blocks kept on the heap the next step reuses them
without a fault; the process's own peak is unchanged (the same live tensors), but the memory it
frees between steps stays resident, so the peaks of the run's processes, which fall at different
moments, add up more in the tree's peak. Where steps are small (the 1m model's two-token answers)
that costs a few MiB and gains nothing, so :class:`HeapKeeper` turns it on only once a step
faulted more than its threshold (docs/benchmarks.md as of 58f8d09, the grid section).

The opposite, trimming the heap after each step, makes the next step slower for the same
reason (measured: docs/benchmarks.md as of 58f8d09).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
from contextlib import contextmanager
from typing import Iterator

__all__ = ["HeapKeeper", "keep_freed_heap"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
# Blocks below 32 MiB (glibc's largest dynamic threshold) from the heap. Larger ones (a weight
# push bundle) keep their own mapping: on the heap, such a block freed and followed by a slightly
# larger one can leave a hole that grows the heap (the likely reading of a 50m x 2 grid point
# whose peak RSS rose ~200 MiB with 1 GiB here, measured at d9892fb), and they are few
# per step; the activations the faults came from are all below it at 1m x 64.
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: never trim in practice


def keep_freed_heap() -> bool:
    """Set glibc malloc (``mallopt``) to serve blocks below 32 MiB from the heap and never trim it.

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
    return mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1


class HeapKeeper:
    """Turns :func:`keep_freed_heap` on in this process once one watched step faulted more than
    ``threshold_bytes`` of pages in (``getrusage`` minor faults times the page size).

    Usage: ``with keeper.watch(): step()`` around each trainer step / engine ``generate``; after
    it turned on, ``watch`` costs nothing. The step that turns it on and the next one still fault
    (their large blocks were mapped anew, then first placed on the heap); later ones reuse them.
    Not thread-safe (an actor's steps run one at a time).

    Args:
        threshold_bytes: faulted bytes in one step that turn it on (default 16 MiB: the 1m model's
            two-token steps stay below it, its 64-token ones fault 50-70 MiB).
    """

    def __init__(self, threshold_bytes: int = 16 << 20) -> None:
        self.threshold_bytes = threshold_bytes
        self.on = False

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Count the minor faults of the ``with`` body; turn keeping on when they exceed the
        threshold (also when the body raised: the pages were faulted all the same)."""
        if self.on:
            yield
            return
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            yield
        finally:
            faulted = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * resource.getpagesize()
            if faulted > self.threshold_bytes:
                self.on = True
                kept = keep_freed_heap()
                log.info("a step faulted %.0f MiB of pages in: freed heap kept from now on (%s)",
                         faulted / 2**20, "glibc" if kept else "not glibc: unchanged")
