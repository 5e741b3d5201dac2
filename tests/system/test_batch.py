"""replayrl.transport.batch and the sockets' coalescing (docs/design/transport.md#shm-transport,
"Batches"): the batch frame's layout (checked against bytes built by hand with
struct), order, limits, malformed batches refused whole naming the element, shared-memory slots
released exactly once, and a live actor that survives a malformed batch.

Waits use asyncio.wait_for only as a hang guard; nothing asserts on timing."""
from __future__ import annotations

import asyncio
import struct
import tempfile

import numpy as np
import pytest
import zmq

from replayrl.actors import ActorSpec, Directory, Supervisor
from replayrl.transport import Codec, DealerSocket, DecodeError, RouterSocket, ipc_endpoint
from replayrl.transport.batch import MAX_BATCH_MESSAGES, pack_batch, split_batch
from replayrl.transport.shm_pool import ShmPool, ShmReader

GUARD_S = 60
MiB = 1 << 20


@pytest.fixture
def run_dir():
    with tempfile.TemporaryDirectory(prefix="rrl-") as d:  # short path: AF_UNIX limit
        yield d


def _by_hand(bodies: list[bytes]) -> bytes:
    """The batch layout of the module docstring, written out with struct."""
    out = bytes([0xC1]) + struct.pack("<I", len(bodies))
    out += b"".join(struct.pack("<I", len(b)) for b in bodies)
    return out + b"".join(bodies)


def test_a_batch_frame_is_the_documented_layout_and_splits_back_in_order():
    bodies = [b"a", b"\x00" * 300, bytes(range(256)), b"\xc1zz"]
    frame = pack_batch(bodies)
    assert frame == _by_hand(bodies)
    views = split_batch(memoryview(frame))
    assert [bytes(v) for v in views] == bodies
    assert all(v.obj is frame for v in views)  # views of the frame, not copies


@pytest.mark.parametrize("frame, needle", [
    (b"\xc1\x01", "shorter than its 5-byte head"),
    (b"\xc1" + struct.pack("<I", 0), "batch of 0 messages"),
    (b"\xc1" + struct.pack("<I", MAX_BATCH_MESSAGES + 1), f"batch of {MAX_BATCH_MESSAGES + 1} messages"),
    (b"\xc1" + struct.pack("<I", 1000) + b"\x01\x00", "its lengths need 4005 bytes"),
    (_by_hand([b"ab", b"cd", b"ef"])[:-1], "batch element 2 of 3 of 2 bytes at offset 21 runs past"),
    (_by_hand([b"ab", b"cd"]) + b"!", "1 bytes after element 1, the last one"),
    (b"\xc1" + struct.pack("<III", 2, 1, 0) + b"x", "batch element 1 of 2 is empty"),
])
def test_a_malformed_batch_is_refused_naming_the_element(frame, needle):
    with pytest.raises(DecodeError) as caught:
        split_batch(memoryview(frame))
    assert needle in str(caught.value)


async def test_a_burst_leaves_as_few_zeromq_messages_in_order(run_dir):
    """A raw pyzmq ROUTER (not our reader) sees the first message alone and the rest of the
    loop iteration's burst as one batch frame."""
    raw = zmq.Context.instance().socket(zmq.ROUTER)
    endpoint = ipc_endpoint(run_dir, "raw")
    raw.bind(endpoint)
    dealer = DealerSocket(endpoint, lambda frames: None)
    dealer.connect()
    try:
        bodies = [f"message {i}".encode() for i in range(100)]
        for body in bodies:
            dealer.send([body])
        await asyncio.sleep(0)  # the iteration ends: the queued 99 leave
        got = []
        while len(got) < 2:
            if raw.poll(GUARD_S * 1000) == 0:
                pytest.fail("nothing arrived")
            got.append(raw.recv_multipart()[1:])
        assert got[0] == [bodies[0]]
        assert len(got[1]) == 1 and got[1][0] == _by_hand(bodies[1:])
    finally:
        dealer.close()
        raw.close(linger=0)


async def test_batches_keep_order_and_stay_under_the_message_limit(run_dir):
    """Single-frame and multi-frame messages, mixed, arrive in order; no ZeroMQ message passes
    the 4 KiB limit (the router would drop the connection of a peer that sent one)."""
    got: list[bytes] = []
    sizes: list[int] = []
    done = asyncio.get_running_loop().create_future()
    expected = []
    for i in range(300):
        body = bytes([i % 200 + 1]) * (1000 + i)
        expected.append([body, b"second frame"] if i % 50 == 7 else [body])

    def on_message(peer, frames):
        got.append([bytes(f) for f in frames])
        if len(got) == len(expected):
            done.set_result(None)

    router = RouterSocket(ipc_endpoint(run_dir, "r"), on_message, max_message_bytes=4096)
    router.bind()
    dealer = DealerSocket(router.endpoint, lambda frames: None, max_message_bytes=4096)
    dealer.connect()
    sent = dealer._sock.send

    def spy(frame, *args, **kwargs):  # every ZeroMQ frame that leaves
        sizes.append(len(frame))
        return sent(frame, *args, **kwargs)

    dealer._sock.send = spy
    try:
        for frames in expected:
            dealer.send(frames)
        await asyncio.wait_for(done, GUARD_S)
        assert got == expected
        assert max(sizes) <= 4096
        assert len(sizes) < len(expected) // 2  # coalesced: each batch holds 2-3 messages
    finally:
        dealer.close()
        router.close()


async def test_a_malformed_batch_is_reported_and_the_socket_serves_on(run_dir):
    got: list[bytes] = []
    bad: list[tuple] = []
    router = RouterSocket(ipc_endpoint(run_dir, "r"), lambda peer, frames: got.append(bytes(frames[0])),
                          on_bad_batch=lambda peer, exc: bad.append((peer, str(exc))))
    router.bind()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, b"raw-peer")
    raw.connect(router.endpoint)
    try:
        raw.send(_by_hand([b"x", b"yy", b"zzz"])[:-2])  # element 2 truncated
        raw.send(pack_batch([b"after", b"the bad one"]))
        while len(got) < 2:
            await asyncio.sleep(0.01)
        assert got == [b"after", b"the bad one"]  # nothing of the bad batch was delivered
        assert bad == [(b"raw-peer", bad[0][1])] and "batch element 2 of 3" in bad[0][1]
    finally:
        raw.close(linger=0)
        router.close()


async def test_a_payload_starting_with_the_marker_arrives_intact(run_dir):
    got: list[list[bytes]] = []
    router = RouterSocket(ipc_endpoint(run_dir, "r"), lambda peer, frames: got.append([bytes(f) for f in frames]))
    router.bind()
    dealer = DealerSocket(router.endpoint, lambda frames: None)
    dealer.connect()
    try:
        dealer.send([b"\xc1 not a batch"])  # alone: the first of the iteration
        await asyncio.sleep(0)
        dealer.send([b"\xc1" * (70 << 10)])  # too large for a batch, alone again
        dealer.send([b"\xc1", b"second"])  # multipart: never read as a batch
        while len(got) < 3:
            await asyncio.sleep(0.01)
        assert got == [[b"\xc1 not a batch"], [b"\xc1" * (70 << 10)], [b"\xc1", b"second"]]
    finally:
        dealer.close()
        router.close()


async def test_shared_memory_slots_in_a_batch_are_released_once_each(run_dir):
    """Slots travel in a batch and are the receiver's until it drops its views; a batch dropped
    unsent (socket closed before the iteration ended) releases its slots once, and a later
    fill of the same slot is not released by the dropped message."""
    pool, reader, codec = ShmPool(64 * MiB, 64 << 10), ShmReader(), Codec()
    kept = []
    router = RouterSocket(ipc_endpoint(run_dir, "r"), lambda peer, frames: kept.append(codec.decode(frames, reader)))
    router.bind()
    dealer = DealerSocket(router.endpoint, lambda frames: None)
    dealer.connect()
    try:
        arrays = [np.full(MiB // 4, i, dtype=np.float32) for i in range(5)]
        for a in arrays:
            dealer.send(codec.encode({"x": a}, pool))
        await asyncio.wait_for(_until(lambda: len(kept) == 5), GUARD_S)
        assert [float(m["x"][0]) for m in kept] == [0, 1, 2, 3, 4]
        assert pool.busy() == 5  # the receiver holds every view
        kept.clear()
        assert pool.busy() == 0
        # queued behind a first message, then the socket closes before the iteration ends
        other = DealerSocket(router.endpoint, lambda frames: None)
        other.connect()
        other.send([b"first"])
        other.send(codec.encode({"x": arrays[0]}, pool))
        assert pool.busy() == 1
        other.close()
        assert pool.busy() == 0
        # the slot is filled again; the dropped message does not release the new fill
        dealer.send(codec.encode({"x": arrays[1]}, pool))
        await asyncio.wait_for(_until(lambda: len(kept) == 1), GUARD_S)
        assert pool.busy() == 1 and float(kept[0]["x"][0]) == 1
        kept.clear()
        assert pool.busy() == 0
    finally:
        dealer.close()
        router.close()
        pool.close()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


async def test_a_live_actor_survives_a_malformed_batch(run_dir):
    directory = Directory.for_run(run_dir, ["a"])
    async with Supervisor([ActorSpec("a", "tests.actor_fixtures:EchoActor")], directory, run_dir):
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(directory.endpoint("a"))
        try:
            call = Codec().encode({"k": "call", "id": 5, "m": "echo", "a": ["ok"], "kw": {}})[0]
            raw.send(_by_hand([call, call])[:-3])  # truncated: refused whole, nothing answered
            raw.send(pack_batch([call, call]))  # a good batch: both answered
            replies = []
            while len(replies) < 2:
                if raw.poll(GUARD_S * 1000) == 0:
                    pytest.fail("no reply")
                frames = raw.recv_multipart()
                bodies = split_batch(memoryview(frames[0])) if frames[0][:1] == b"\xc1" else frames
                replies += [Codec().decode([b]) for b in bodies]
            assert replies == [{"k": "ok", "id": 5, "v": "ok"}] * 2
        finally:
            raw.close(linger=0)
        assert await directory.ref("a").call("echo", "still serving", timeout=GUARD_S) == "still serving"
