"""Benchmark: the transport against baselines measured in the same run (not a test).

Prints one markdown table (docs/design/transport.md#shm-transport; the
transport table of docs/benchmarks.md is its output):

* one-way array throughput at 4 KiB, 1 MiB and 64 MiB float32 (encode -> ipc send -> receive
  -> decode, both ends on one asyncio loop, the decoded array dropped at once) as a fraction
  of ``np.copyto`` into a reused buffer of the same size: as ZeroMQ frames (the pool off) and
  through the shared-memory pool (``replayrl.transport.shm_pool``); 4 KiB travels inline either way;
* actor call round trip, median of single calls (1 in flight), and calls/s with 64 in flight,
  to an actor in another process (``ActorRef.call`` over ipc), against a raw pyzmq DEALER ->
  ROUTER echo of a message of the same size, also in another process;
* the floor under that round trip, in the same run and against the same raw baseline: an echo
  at the socket level (``replayrl.transport.sockets``: a ``DealerSocket`` client awaiting a future, a
  ``RouterSocket`` replying from ``on_message``; raw bytes, no codec, no actor), and each
  side of it against the raw blocking other side, the asyncio side run by
  ``replayrl.actors.loop.run_event_loop`` as actors run (uvloop when installed);
* for a 1 MiB array one way, the time per message above the memcpy of the same bytes, next
  to what 0.9x memcpy would allow;
* a weight push (``replayrl.transport.array_bundle`` of 16 float32 arrays, ``--push-mib`` in all) to
  an actor in another process that reads every array, as ZeroMQ frames and through the pool;
* small messages/s: a small call envelope encoded, sent, received and decoded one way;
* where Ray is installed (``pip install ray``, not a dependency): a Ray actor call's median
  round trip, calls/s with 64 in flight, and a 64 MiB array driver -> actor.

The machine's load average and core count are printed first: the figures are medians of
``--repeats`` runs and move with whatever else the machine runs.

With ``--priority`` the benchmark and the actor it spawns run ahead of other sessions' jobs
(:mod:`replayrl.tools.bench.priority`), both sides of every ratio alike.

Usage: ``python -m replayrl.tools.bench.transport [--repeats 3] [--calls 4000] [--push-mib 256] [--priority]``
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import zmq

from replayrl.actors import Actor, ActorSpec, Directory, Supervisor
from replayrl.actors.loop import run_event_loop
from replayrl.actors.ref import use_shared_memory
from replayrl.tools.bench.usage import at_least, bench_parser
from replayrl.transport import Codec, DealerSocket, RouterSocket, ipc_endpoint
from replayrl.transport.array_bundle import pack_arrays, unpack_arrays
from replayrl.transport.shm_pool import ShmPool, ShmReader

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
# the size whose per-message overhead is printed, and the target it is held against: one way
# >= 0.9x memcpy at >= 1 MiB (docs/design/transport.md#shm-transport, why it is not met)
_OVERHEAD_SIZE = "1 MiB"
_TARGET_OF_MEMCPY = 0.9
_FLOOR_TIMEOUT_S = 60  # an echo server of the floor rows that stops answering fails the run
_BYTES_PER_RUN = 256 << 20  # per measurement: enough to dominate setup
_SMALL = {"k": "tell", "id": 1, "m": "record", "a": [1], "kw": {}}


class BenchEcho(Actor):
    """The actor the call benchmark calls: ``echo`` returns its argument, ``nbytes`` an array's size."""

    async def echo(self, value):
        return value

    async def nbytes(self, array: np.ndarray) -> int:
        return int(array.nbytes)

    async def load(self, bundle: dict) -> float:
        """What an engine's weight load does with a push: read every array once (a sum)."""
        return float(sum(float(a.sum(dtype=np.float64)) for a in unpack_arrays(bundle).values()))


def memcpy_bytes_per_s(nbytes: int, repeats: int) -> float:
    """Median bytes/s of ``np.copyto`` between two pre-faulted buffers of ``nbytes``."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)
    count = max(4, _BYTES_PER_RUN // nbytes)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            np.copyto(dst, src)
        rates.append(nbytes * count / (time.perf_counter() - start))
    return statistics.median(rates)


async def _one_way(endpoint: str, codec: Codec, messages: list, count: int,
                   pool: ShmPool | None, reader: ShmReader | None, yield_every: int) -> float:
    """Seconds to send ``count`` messages (cycling through ``messages``) and decode each,
    letting the receiver drain every ``yield_every`` sends."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    received = 0

    def on_message(peer: bytes, frames: list) -> None:
        nonlocal received
        codec.decode(frames, reader)  # dropped at once: a shared-memory slot is released
        received += 1
        if received == count:
            done.set_result(None)

    router = RouterSocket(endpoint, on_message)
    dealer = DealerSocket(endpoint, lambda frames: None)
    router.bind()
    dealer.connect()
    try:
        start = time.perf_counter()
        for i in range(count):
            dealer.send(codec.encode(messages[i % len(messages)], pool))
            if i % yield_every == yield_every - 1:
                await asyncio.sleep(0)  # let the receiver drain, as a live sender would
        await done
        return time.perf_counter() - start
    finally:
        dealer.close()
        router.close()


def one_way_bytes_per_s(nbytes: int, shm: bool, repeats: int) -> float:
    """Median bytes/s of encode -> ipc send -> receive -> decode of one float32 array of ``nbytes``."""
    codec = Codec()
    array = np.ones(nbytes // 4, dtype=np.float32)
    count = max(8, _BYTES_PER_RUN // nbytes)
    pool, reader = (ShmPool(1 << 30), ShmReader()) if shm else (None, None)
    # a large array's sender waits for the receiver (a weight push awaits its load), so a
    # slot goes back to the pool before the next message; small ones go in bursts of 64
    yield_every = 1 if nbytes >= 1 << 20 else 64
    rates = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for i in range(repeats + 1):  # the first run makes the slots and mappings: not counted
            seconds = run_event_loop(_one_way(ipc_endpoint(tmp, f"b{i}.sock"), codec, [array], count,
                                           pool, reader, yield_every))
            if i:
                rates.append(nbytes * count / seconds)
    if pool is not None:
        pool.close()
    return statistics.median(rates)


def small_messages_per_s(repeats: int, count: int = 50_000) -> float:
    """Median small messages/s one way (a call envelope: encode, send, receive, decode)."""
    codec = Codec()
    rates = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for i in range(repeats):
            seconds = run_event_loop(_one_way(ipc_endpoint(tmp, f"s{i}.sock"), codec, [_SMALL], count,
                                           None, None, 64))
            rates.append(count / seconds)
    return statistics.median(rates)


# -- calls -------------------------------------------------------------------------------------
async def _actor_calls(ref, calls: int, in_flight: int) -> tuple[float, float]:
    """(median seconds of one call with nothing else in flight, calls/s with ``in_flight``)."""
    for _ in range(200):  # warm the connection and the interface
        await ref.call("echo", 1)
    latencies = []
    for _ in range(calls):
        start = time.perf_counter()
        await ref.call("echo", 1)
        latencies.append(time.perf_counter() - start)
    left = calls * 4

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await ref.call("echo", 1)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return statistics.median(latencies), calls * 4 / (time.perf_counter() - start)


def _raw_echo_server(endpoint: str, ready) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[-1].bytes == b"stop":
            sock.send_multipart(frames)
            return
        sock.send_multipart(frames, copy=False)


def raw_zmq_calls(endpoint: str, calls: int, in_flight: int) -> tuple[float, float]:
    """The same two figures for a raw pyzmq DEALER -> ROUTER echo in another process, with a
    payload of the size of an actor call's request."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_raw_echo_server, args=(endpoint, ready), daemon=True)
    server.start()
    ready.wait(30)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    payload = _call_payload()
    try:
        p50 = _raw_round_trip_p50(sock, payload, calls)
        total = calls * 4
        start = time.perf_counter()
        for _ in range(in_flight):
            sock.send(payload)
        for i in range(total):
            sock.recv()
            if i + in_flight < total:
                sock.send(payload)
        rate = total / (time.perf_counter() - start)
        sock.send(b"stop")
        sock.recv()
    finally:
        sock.close(linger=0)
        server.join(10)
        if server.is_alive():
            server.kill()
    return p50, rate


def _call_payload() -> bytes:
    """One frame of the size of an actor call's request (the round-trip payload of every echo)."""
    return Codec().encode({"k": "call", "id": 123456, "m": "echo", "a": [1], "kw": {}})[0]


def _raw_round_trip_p50(sock: zmq.Socket, payload: bytes, calls: int) -> float:
    """Median seconds of ``calls`` blocking send + recv round trips on a connected DEALER,
    after 200 untimed ones."""
    for _ in range(200):
        sock.send(payload)
        sock.recv()
    latencies = []
    for _ in range(calls):
        start = time.perf_counter()
        sock.send(payload)
        sock.recv()
        latencies.append(time.perf_counter() - start)
    return statistics.median(latencies)


# -- the socket-level floor under a call (docs/design/transport.md#shm-transport) --
@dataclass(frozen=True)
class SocketFloor:
    """Median round-trip seconds (1 in flight, the call-request payload, raw bytes) of echoes
    without codec or actor, each with its server in another process.

    Attributes:
        asyncio_both: ``DealerSocket`` client against a ``RouterSocket`` echo server.
        raw_client: blocking pyzmq DEALER client against the ``RouterSocket`` echo server.
        raw_server: ``DealerSocket`` client against the blocking pyzmq ROUTER echo server.
    """

    asyncio_both: float
    raw_client: float
    raw_server: float


async def _asyncio_echo(endpoint: str, ready) -> None:
    """Echo every message from ``on_message`` until one whose last frame is ``b"stop"``."""
    stopped = asyncio.get_running_loop().create_future()

    def on_message(peer: bytes, frames: list) -> None:
        router.send(peer, frames)  # the views are copied by send (replayrl.transport.sockets.owned_frames)
        if frames[-1] == b"stop" and not stopped.done():
            stopped.set_result(None)

    router = RouterSocket(endpoint, on_message)
    router.bind()
    ready.set()
    try:
        await stopped
        await asyncio.sleep(0.1)  # LINGER 0: let ZeroMQ's I/O thread flush the stop reply first
    finally:
        router.close()


def _asyncio_echo_server(endpoint: str, ready) -> None:
    """Process entry: :func:`_asyncio_echo` on the loop an actor process runs."""
    run_event_loop(_asyncio_echo(endpoint, ready))


async def _asyncio_round_trip_p50(endpoint: str, payload: bytes, calls: int) -> float:
    """Median seconds of ``calls`` round trips of a ``DealerSocket`` awaiting a future that its
    ``on_message`` resolves (200 untimed first), then a ``b"stop"`` round trip."""
    loop = asyncio.get_running_loop()
    reply: asyncio.Future | None = None

    def on_message(frames: list) -> None:
        reply.set_result(None)

    dealer = DealerSocket(endpoint, on_message)
    dealer.connect()

    async def round_trip(frame: bytes) -> None:
        nonlocal reply
        reply = loop.create_future()
        dealer.send([frame])
        await reply

    try:
        # one timer for the whole run (not per round trip): a server that died is an error, not a hang
        async with asyncio.timeout(_FLOOR_TIMEOUT_S + calls * 0.05):
            for _ in range(200):
                await round_trip(payload)
            latencies = []
            for _ in range(calls):
                start = time.perf_counter()
                await round_trip(payload)
                latencies.append(time.perf_counter() - start)
            await round_trip(b"stop")
    except TimeoutError as exc:
        raise RuntimeError(f"echo server at {endpoint!r} stopped answering") from exc
    finally:
        dealer.close()
    return statistics.median(latencies)


def _spawn_server(target, endpoint: str):
    """Start ``target(endpoint, ready)`` in a spawned process; return it once it has bound."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=target, args=(endpoint, ready), daemon=True)
    server.start()
    deadline = time.monotonic() + 60
    while not ready.wait(0.1):
        if not server.is_alive() or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"echo server {target.__name__} did not bind {endpoint!r} "
                               f"(exit code {server.exitcode}; waited up to 60 s)")
    return server


def _stop(server) -> None:
    server.join(10)
    if server.is_alive():
        server.kill()


def _asyncio_client_p50(server_fn, endpoint: str, payload: bytes, calls: int) -> float:
    """p50 seconds of our asyncio client's round trips against ``server_fn`` serving
    ``endpoint`` in a process of its own (stopped afterwards)."""
    server = _spawn_server(server_fn, endpoint)
    try:
        return run_event_loop(_asyncio_round_trip_p50(endpoint, payload, calls))
    finally:
        _stop(server)


def socket_floor(run_dir: str, calls: int) -> SocketFloor:
    """Measure the three :class:`SocketFloor` round trips over ipc endpoints in ``run_dir``
    (a directory of mode 0700), ``calls`` timed round trips each, the asyncio client on
    :func:`replayrl.actors.loop.run_event_loop`."""
    payload = _call_payload()
    asyncio_both = _asyncio_client_p50(_asyncio_echo_server, ipc_endpoint(run_dir, "floor-a.sock"),
                                       payload, calls)
    server = _spawn_server(_asyncio_echo_server, ipc_endpoint(run_dir, "floor-b.sock"))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, _FLOOR_TIMEOUT_S * 1000)  # a dead server: zmq.Again, not a hang
    try:
        sock.connect(ipc_endpoint(run_dir, "floor-b.sock"))
        raw_client = _raw_round_trip_p50(sock, payload, calls)
        sock.send(b"stop")
        sock.recv()
    finally:
        sock.close(linger=0)
        _stop(server)
    raw_server = _asyncio_client_p50(_raw_echo_server, ipc_endpoint(run_dir, "floor-c.sock"),
                                     payload, calls)
    return SocketFloor(asyncio_both, raw_client, raw_server)


def floor_rows(floor: SocketFloor, raw_p50: float) -> list[str]:
    """The table rows of ``floor`` (seconds), each against ``raw_p50``, the raw pyzmq
    DEALER/ROUTER round trip of the same run (seconds)."""
    rows = [("asyncio sockets both sides (no codec, no actor)", floor.asyncio_both),
            ("raw pyzmq client -> asyncio socket server", floor.raw_client),
            ("asyncio socket client -> raw pyzmq server", floor.raw_server)]
    return [f"| floor: echo round trip, 1 in flight (p50), {what} | {seconds * 1e6:.0f} us "
            f"| {seconds / raw_p50:.2f}x raw zmq |" for what, seconds in rows]


def overhead_row(label: str, nbytes: int, memcpy: float, frames: float, shm: float) -> str:
    """A table row: per-message time of one-way ``nbytes`` messages above a memcpy of them.

    Args:
        label: the size's name (e.g. ``"1 MiB"``).
        nbytes: message size, bytes.
        memcpy, frames, shm: bytes/s of memcpy, of one way as ZeroMQ frames and through the pool.

    The memcpy takes ``nbytes / memcpy`` seconds; a message ``nbytes / rate``; the overhead is
    their difference. At ``_TARGET_OF_MEMCPY`` (0.9x) a message may take ``memcpy_s / 0.9``,
    i.e. an overhead of ``memcpy_s * (1 / 0.9 - 1)``.
    """
    copy_s = nbytes / memcpy
    allowed = copy_s * (1 / _TARGET_OF_MEMCPY - 1)
    return (f"| one-way {label} array, time per message above memcpy | memcpy {copy_s * 1e6:.1f} us; "
            f"ZeroMQ frames {(nbytes / frames - copy_s) * 1e6:+.1f} us, shared memory "
            f"{(nbytes / shm - copy_s) * 1e6:+.1f} us | {_TARGET_OF_MEMCPY}x memcpy allows "
            f"{allowed * 1e6:+.1f} us |")


async def _push_seconds(ref, bundle: dict, repeats: int) -> float:
    """Median seconds of one weight-push-shaped call: a bundle in, every array read, a float out."""
    seconds = []
    for _ in range(repeats + 1):  # the first makes the slots and mappings: not counted
        start = time.perf_counter()
        await ref.call("load", bundle)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


async def _actor_figures(calls: int, in_flight: int, push_bytes: int,
                         repeats: int) -> tuple[float, float, float, float]:
    """Call p50 and rate, and a ``push_bytes`` weight push's seconds as frames and through the pool."""
    with tempfile.TemporaryDirectory(prefix="bench-") as run_dir:
        directory = Directory.for_run(run_dir, ["echo"])
        async with Supervisor([ActorSpec("echo", "replayrl.tools.bench.transport:BenchEcho", {})], directory, run_dir):
            ref = directory.ref("echo")
            p50, rate = await _actor_calls(ref, calls, in_flight)
            # a weight push as the trainer sends it: named arrays packed one buffer per dtype
            rng = np.random.default_rng(0)
            weights = {f"layer{i}.weight": rng.standard_normal(push_bytes // 64, dtype=np.float32)
                       for i in range(16)}
            bundle = pack_arrays(weights)
            with_shm = await _push_seconds(ref, bundle, repeats)
            use_shared_memory(0, 1)  # the same push as ZeroMQ frames
            try:
                frames = await _push_seconds(ref, bundle, repeats)
            finally:
                use_shared_memory(*directory.shm)
            return p50, rate, frames, with_shm


# -- Ray (optional) ----------------------------------------------------------------------------
def ray_figures(calls: int, in_flight: int, repeats: int) -> tuple[float, float, float] | None:
    """(median call seconds, calls/s at ``in_flight``, 64 MiB driver -> actor bytes/s), or None
    when Ray is not installed."""
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote
        class Echo:
            def echo(self, value):
                return value

            def nbytes(self, array):
                return int(array.nbytes)

        actor = Echo.remote()
        for _ in range(200):
            ray.get(actor.echo.remote(1))
        latencies = []
        for _ in range(calls):
            start = time.perf_counter()
            ray.get(actor.echo.remote(1))
            latencies.append(time.perf_counter() - start)
        total = calls * 4
        start = time.perf_counter()
        pending = [actor.echo.remote(1) for _ in range(in_flight)]
        sent = in_flight
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
            if sent < total:
                pending.append(actor.echo.remote(1))
                sent += 1
        rate = total / (time.perf_counter() - start)
        array = np.ones((64 << 20) // 4, dtype=np.float32)
        rates = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            ray.get(actor.nbytes.remote(array))  # put into the object store, the actor maps it
            rates.append(array.nbytes / (time.perf_counter() - start))
        return statistics.median(latencies), rate, statistics.median(rates[1:])
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Print the conditions and the table (module docstring)."""
    parser = bench_parser("transport", __doc__)
    parser.add_argument("--repeats", type=at_least(1), default=3,
                        help="runs of every measurement; the table shows their medians")
    parser.add_argument("--calls", type=at_least(1), default=4000,
                        help="single calls timed (x4 at 64 in flight)")
    parser.add_argument("--push-mib", type=at_least(1), default=256,
                        help="MiB of the weight push timed")
    parser.add_argument("--priority", action="store_true",
                        help="on a machine shared with other users' jobs, run this benchmark and "
                             "its actor first (Linux autogroup nice -20; needs root)")
    args = parser.parse_args(argv)
    from replayrl.tools.bench.priority import autogroup_priority

    with autogroup_priority(args.priority):
        _table(args)


def _table(args: argparse.Namespace) -> None:
    """Print the conditions line and the table (one run of every measurement)."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"conditions: {os.cpu_count()} CPUs, load average {load} (1, 5, 15 min); "
          f"medians of {args.repeats} runs; ipc on one node"
          f"{'; --priority: ahead of other sessions (tools/bench/priority.py)' if args.priority else ''}")
    print()
    print("| measurement | result | against the baseline of this run |")
    print("|---|---|---|")
    for label, nbytes in SIZES.items():
        base = memcpy_bytes_per_s(nbytes, args.repeats)
        frames = one_way_bytes_per_s(nbytes, False, args.repeats)
        line = f"| one-way {label} array | memcpy {base / 1e9:.1f} GB/s; "
        if nbytes < 64 << 10:
            print(line + f"inline {frames / 1e9:.2f} GB/s | {frames / base:.3f}x memcpy |")
            continue
        shm = one_way_bytes_per_s(nbytes, True, args.repeats)
        print(line + f"ZeroMQ frames {frames / 1e9:.2f} GB/s, shared memory {shm / 1e9:.2f} GB/s "
              f"| frames {frames / base:.3f}x, shared memory {shm / base:.3f}x memcpy |")
        if label == _OVERHEAD_SIZE:
            print(overhead_row(label, nbytes, base, frames, shm))
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        raw_p50, raw_rate = raw_zmq_calls(ipc_endpoint(tmp, "raw.sock"), args.calls, 64)
        floor = socket_floor(tmp, args.calls)
    p50, rate, push_frames, push_shm = run_event_loop(_actor_figures(args.calls, 64, args.push_mib << 20,
                                                                  args.repeats))
    print(f"| call round trip, 1 in flight (p50) | actor {p50 * 1e6:.0f} us; raw pyzmq DEALER/ROUTER "
          f"{raw_p50 * 1e6:.0f} us | {p50 / raw_p50:.2f}x raw zmq |")
    for row in floor_rows(floor, raw_p50):
        print(row)
    print(f"| calls/s, 64 in flight | actor {rate / 1e3:.1f}k/s; raw pyzmq {raw_rate / 1e3:.1f}k/s "
          f"| {rate / raw_rate:.2f}x raw zmq |")
    print(f"| weight push of {args.push_mib} MiB (16 arrays, one bundle) to an actor that reads it | "
          f"ZeroMQ frames {push_frames * 1e3:.0f} ms, shared memory {push_shm * 1e3:.0f} ms | "
          f"{push_frames / push_shm:.2f}x faster |")
    small = small_messages_per_s(args.repeats)
    print(f"| small messages/s, one way (encode, send, receive, decode) | {small / 1e3:.0f}k/s | |")
    ray = ray_figures(args.calls // 4, 64, args.repeats)
    if ray is None:
        print("| Ray | not installed (`pip install ray` to compare) | |")
    else:
        ray_p50, ray_rate, ray_bytes = ray
        base = memcpy_bytes_per_s(64 << 20, args.repeats)
        print(f"| Ray actor call, 1 in flight (p50) | {ray_p50 * 1e6:.0f} us | {ray_p50 / raw_p50:.2f}x raw zmq |")
        print(f"| Ray calls/s, 64 in flight | {ray_rate / 1e3:.1f}k/s | {ray_rate / raw_rate:.2f}x raw zmq |")
        print(f"| Ray 64 MiB driver -> actor | {ray_bytes / 1e9:.2f} GB/s | {ray_bytes / base:.3f}x memcpy |")


if __name__ == "__main__":
    main()
