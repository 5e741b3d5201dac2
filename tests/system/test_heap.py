"""keep_freed_heap / HeapKeeper: a large block freed and allocated again is not faulted in again.

Counted by the kernel (``getrusage`` minor faults) in a fresh process, with glibc's own
``malloc`` / ``free``: 24 MiB touched twice faults ~6,144 pages the second time by default
(glibc unmaps a block that large when it is freed) and next to none with the setting; a
HeapKeeper turns it on after a watched step above its threshold, not after a small one.
"""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, resource, sys
from replayrl.actors.heap import HeapKeeper, keep_freed_heap
applied = keep_freed_heap() if sys.argv[1] == "keep" else None
keeper = HeapKeeper(threshold_bytes=16 << 20)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def touch(size=24 << 20):
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
if sys.argv[1] == "keeper":
    with keeper.watch():
        touch(1 << 20)  # below the threshold: stays off
    small = keeper.on
    with keeper.watch():
        touch()
    applied = (small, keeper.on)
touch()  # the block's first time on the heap (or, by default, mapped again) faults
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(str(applied).replace(" ", ""), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt and its thresholds are glibc's")


def _second_round_faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


def test_a_freed_block_is_reused_without_faults():
    pages = (24 << 20) // 4096
    applied, kept = _second_round_faults("keep")
    _, default = _second_round_faults("default")
    assert applied == "True"
    assert default > pages // 2  # glibc's default gave the block back: every page faults again
    assert kept < pages // 20


def test_the_keeper_turns_on_after_a_large_step_only():
    pages = (24 << 20) // 4096
    turned, faults = _second_round_faults("keeper")
    assert turned == "(False,True)"  # off after the 1 MiB step, on after the 24 MiB one
    # the block of that step was mapped and unmapped; the next one is faulted in on the heap
    # once, and reused from then on
    assert faults < pages // 20
