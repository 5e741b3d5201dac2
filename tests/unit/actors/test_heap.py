"""release_free_heap hands freed heap pages back: RSS read from /proc/self/status (the kernel's
count, not the code under test) drops by most of what was freed in the middle of the heap."""
from __future__ import annotations

import ctypes
import sys

import pytest

from replayrl.actors.heap import release_free_heap

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


def test_freed_heap_in_the_middle_is_released():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    block = 32 * 1024  # below glibc's mmap threshold: the blocks live in the heap
    blocks = [libc.malloc(block) for _ in range(2048)]  # 64 MiB
    for b in blocks:
        ctypes.memset(b, 1, block)  # touched: resident
    for b in blocks[:-1]:  # the last one stays, so free cannot shrink the heap from its top
        libc.free(b)
    before = _rss_anon_mib()
    assert release_free_heap() is True
    after = _rss_anon_mib()
    libc.free(blocks[-1])
    assert before - after > 40, (before, after)
