"""Benchmark: transport codec + sockets throughput versus a memcpy baseline (not a test).

For 4 KiB and 64 MiB float32 arrays, sends messages one way from a DealerSocket to a
RouterSocket over ipc:// in one process (both ends on one asyncio loop), decoding each on
arrival, once with the array inline in frame 0 and once out of band (its own frame, copy=False).
Prints the median throughput of each and its ratio to ``np.copyto`` into a reused buffer measured
in the same run (docs/design.md §4 "Transport contract", quotes such ratios).

Usage: ``python -m tools.bench_transport [--repeats 5]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import numpy as np

from transport import Codec, CodecConfig, DealerSocket, RouterSocket, ipc_endpoint

SIZES = {"4 KiB": 4 << 10, "64 MiB": 64 << 20}
# Enough bytes per measurement to dominate setup: ~64 MiB for small messages, 4 messages of 64 MiB.
_MESSAGES = {4 << 10: 16384, 64 << 20: 4}


def memcpy_bytes_per_s(nbytes: int, repeats: int) -> float:
    """Median bytes/s of ``np.copyto`` between two pre-faulted buffers of ``nbytes``."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    count = max(1, (256 << 20) // nbytes)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            np.copyto(dst, src)
        rates.append(nbytes * count / (time.perf_counter() - start))
    return statistics.median(rates)


async def _one_way(endpoint: str, codec: Codec, array: np.ndarray, count: int) -> float:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    received = 0

    def on_message(peer: bytes, frames: list) -> None:
        nonlocal received
        codec.decode(frames)
        received += 1
        if received == count:
            done.set_result(None)

    router = RouterSocket(endpoint, on_message)
    dealer = DealerSocket(endpoint, lambda frames: None)
    router.bind()
    dealer.connect()
    try:
        start = time.perf_counter()
        for _ in range(count):
            dealer.send(codec.encode(array))  # the array is never modified, so no copy is needed
        await done
        return array.nbytes * count / (time.perf_counter() - start)
    finally:
        dealer.close()
        router.close()


def transport_bytes_per_s(nbytes: int, inline: bool, repeats: int) -> float:
    """Median bytes/s of encode -> ipc send -> receive -> decode for one array of ``nbytes``."""
    threshold = nbytes + 1 if inline else 0
    codec = Codec(CodecConfig(inline_threshold=threshold))
    array = np.ones(nbytes // 4, dtype=np.float32)
    rates = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for i in range(repeats):
            endpoint = ipc_endpoint(tmp, f"b{i}.sock")
            rates.append(asyncio.run(_one_way(endpoint, codec, array, _MESSAGES[nbytes])))
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> None:
    """Print one line per size: memcpy GB/s, inline and out-of-band GB/s and their ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    for label, nbytes in SIZES.items():
        base = memcpy_bytes_per_s(nbytes, args.repeats)
        inline = transport_bytes_per_s(nbytes, True, args.repeats)
        oob = transport_bytes_per_s(nbytes, False, args.repeats)
        print(
            f"{label:>7}: memcpy {base / 1e9:6.2f} GB/s | inline {inline / 1e9:6.2f} GB/s ({inline / base:.3f}x)"
            f" | out-of-band {oob / 1e9:6.2f} GB/s ({oob / base:.3f}x) | inline/out-of-band {inline / oob:.2f}x"
        )


if __name__ == "__main__":
    main()
