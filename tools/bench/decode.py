"""Benchmark: what hostile 1 MiB headers cost the codec's decoder, against plain msgpack (not a
test).

For each shape of frame (an array of 2**20 empty lists, of empty dicts, of nested lists, of
two-character strings, of 300s), decodes it once with ``transport.decode`` and once with a plain
``msgpack.unpackb`` (no limits, no hooks: what the decoder did before its budget) and prints the
outcome, the wall time and the peak Python memory (tracemalloc) per wire byte of each, and the
ratio of the two times (docs/design/transport.md#transport-contract).

Usage: ``replayrl bench decode`` (``python -m replayrl.tools.bench.decode``)
"""
from __future__ import annotations

import time
import tracemalloc
from typing import Callable

import msgpack

from replayrl.tools.bench.usage import bench_parser
from replayrl.transport import DecodeError, decode

SHAPES = {"empty lists (0x90)": b"\x90", "empty dicts (0x80)": b"\x80",
          "lists of one empty list": b"\x91\x90", "2-char strings": b"\xa2ab",
          "ints 300": b"\xcd\x01\x2c"}


def frame_of(body: bytes, nbytes: int = 1 << 20) -> bytes:
    """A msgpack array32 of as many copies of ``body`` as fit in ``nbytes``."""
    n = nbytes // len(body)
    return b"\xdd" + n.to_bytes(4, "big") + body * n


def measure(fn: Callable[[bytes], object], frame: bytes) -> tuple[str, float, float]:
    """``(outcome, seconds, peak bytes per wire byte)`` of one ``fn(frame)``; timed without
    tracemalloc, then run again under it for the peak."""
    outcome = "decoded"
    start = time.perf_counter()
    try:
        fn(frame)
    except DecodeError as exc:
        outcome = f"refused ({type(exc).__name__})"
    seconds = time.perf_counter() - start
    tracemalloc.start()
    try:
        fn(frame)
    except DecodeError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return outcome, seconds, peak / len(frame)


def main(argv: list[str] | None = None) -> None:
    """Print one line per frame shape: codec and plain msgpack outcome, ms and peak x wire."""
    bench_parser("decode", __doc__).parse_args(argv)
    for label, body in SHAPES.items():
        frame = frame_of(body)
        ours = measure(lambda f: decode([f]), frame)
        plain = measure(msgpack.unpackb, frame)
        print(f"{label:>24}: codec {ours[0]:<26} {ours[1] * 1e3:7.0f} ms {ours[2]:5.1f}x wire | "
              f"plain msgpack {plain[1] * 1e3:7.0f} ms {plain[2]:5.1f}x wire | time ratio {ours[1] / plain[1]:.2f}")


if __name__ == "__main__":
    main()
