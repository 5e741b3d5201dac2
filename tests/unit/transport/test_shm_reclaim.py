"""Shared-memory slots come back once nobody can read them (docs/design/transport.md#shm-transport):
a refused message releases the slots it names, a reader that exited (told apart from a process
that got its pid) gives its slot back, a message that a later answered one proves unread is
released, and a receiver forgets mappings of slots its sender closed. Header words are read
here with ``os.pread`` at their documented offsets, not through the pool's own accessors."""
from __future__ import annotations

import asyncio
import gc
import os
import tempfile

import msgpack
import numpy as np
import pytest
import zmq

from replayrl.transport import Codec, DealerSocket, DecodeError, TransportError
from replayrl.transport.shm_pool import ShmPool, ShmReader, mark_sent, reader_gone, release_unread

MiB = 1 << 20
TOKEN, CAPACITY, GENERATION, RELEASED, READER = range(5)  # the header's uint64 words, in order


def _words(handle: list) -> list[int]:
    """The five header words of the slot ``handle`` names, read from its memfd."""
    fd = os.open(f"/proc/{handle[0]}/fd/{handle[1]}", os.O_RDONLY)
    try:
        raw = os.pread(fd, 40, 0)
    finally:
        os.close(fd)
    return [int.from_bytes(raw[i:i + 8], "little") for i in range(0, 40, 8)]


def _write_reader(handle: list, value: int) -> None:
    fd = os.open(f"/proc/{handle[0]}/fd/{handle[1]}", os.O_RDWR)
    try:
        os.pwrite(fd, value.to_bytes(8, "little"), 8 * READER)
    finally:
        os.close(fd)


def _start_ticks(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat, parsed here independently of the module under test."""
    text = open(f"/proc/{pid}/stat").read()
    return int(text.rsplit(")", 1)[1].split()[19])


def _handle_of(frames: list) -> list:
    """The one shared-memory handle in a message of one numpy array (the codec's ext 1 payload)."""
    ext = msgpack.unpackb(bytes(frames[0]), ext_hook=lambda code, data: msgpack.unpackb(data))
    return ext[2]


def _sent(frames: list) -> list:
    mark_sent(frames)  # as a socket does once ZeroMQ has the message
    return frames


def test_a_refused_message_releases_the_slots_it_names_without_mapping_them():
    pool, reader = ShmPool(64 * MiB, 64 << 10), ShmReader()
    frames = _sent(Codec().encode(np.ones(MiB // 4, np.float32), pool))
    handle = _handle_of(frames)
    assert _words(handle)[GENERATION] == 1 and _words(handle)[RELEASED] == 0  # busy
    # an unknown ext type before the array: refused before the array is ever decoded
    array_ext = msgpack.unpackb(bytes(frames[0]), ext_hook=msgpack.ExtType)
    bad = [msgpack.packb([msgpack.ExtType(99, b""), array_ext])]
    with pytest.raises(DecodeError, match="unknown ext type 99"):
        Codec().decode(bad, reader)
    assert _words(handle)[RELEASED] == 1 and pool.busy() == 0
    assert reader._maps == {}  # released through the fd, no mapping left behind
    assert _words(handle)[READER] == 0  # nobody decoded it
    # a truncated header still names the handles read before the cut
    frames = _sent(Codec().encode([np.ones(MiB // 4, np.float32), "x" * 100], pool))
    handle = _handle_of([msgpack.packb(msgpack.unpackb(bytes(frames[0]), ext_hook=msgpack.ExtType)[0])])
    assert _words(handle)[RELEASED] != _words(handle)[GENERATION]
    with pytest.raises(DecodeError, match="malformed msgpack"):
        Codec().decode([bytes(frames[0])[:-5]], reader)
    assert _words(handle)[RELEASED] == _words(handle)[GENERATION] and pool.busy() == 0


def test_a_refused_message_leaves_a_slot_alone_while_a_view_of_it_lives():
    pool, reader, codec = ShmPool(64 * MiB, 64 << 10), ShmReader(), Codec()
    frames = _sent(codec.encode(np.full(MiB // 4, 3.0, np.float32), pool))
    view = codec.decode(frames, reader)
    handle = _handle_of(frames)
    assert not reader.release(handle)  # viewed here: refused
    assert _words(handle)[RELEASED] == 0 and float(view[0]) == 3.0
    del view
    gc.collect()
    assert _words(handle)[RELEASED] == 1
    assert not reader.release(handle)  # released already: nothing written
    assert not reader.release([os.getpid(), 1, 2, 3]) and not reader.release("junk")


def test_a_slot_whose_reader_exited_or_whose_pid_was_reused_is_taken_back_and_a_live_one_is_not():
    pool = ShmPool(64 * MiB, 64 << 10)
    frames = _sent(Codec().encode(np.ones(MiB // 4, np.float32), pool))
    handle = _handle_of(frames)
    me, start = os.getpid(), _start_ticks(os.getpid())
    _write_reader(handle, (start << 22) | me)  # a live reader: this process
    assert not reader_gone((start << 22) | me)
    assert pool.put(np.zeros(MiB, np.uint8)) is not None
    assert pool.slot_bytes == 2 * MiB and pool.busy() == 2  # a new slot: the read one stays busy
    # the same pid with another start time: the reader exited and its pid went to a newer process
    _write_reader(handle, ((start + 1) << 22) | me)
    assert reader_gone(((start + 1) << 22) | me)
    placed = pool.put(np.zeros(MiB, np.uint8))
    assert placed is not None and placed[0][1] == handle[1]  # that very slot, reused
    assert pool.slot_bytes == 2 * MiB
    assert _words(handle)[GENERATION] == 2 and _words(handle)[READER] == 0  # reset for its new reader
    # a pid that names no process (a process that took it since would have another start time)
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    gone_pid = next(p for p in range(min(pid_max, 1 << 22) - 1, 1, -1) if not os.path.exists(f"/proc/{p}"))
    assert reader_gone((1 << 22) | gone_pid)
    _write_reader(placed[0], (1 << 22) | gone_pid)
    again = pool.put(np.zeros(MiB, np.uint8))
    assert again is not None and again[0][1] == placed[0][1] and pool.slot_bytes == 2 * MiB


async def test_a_message_proven_unread_by_a_later_answer_is_released_and_a_decoded_one_is_not():
    pool, reader, codec = ShmPool(64 * MiB, 64 << 10), ShmReader(), Codec()
    ctx = zmq.Context.instance()
    with tempfile.TemporaryDirectory(prefix="rrl-") as tmp:
        endpoint = f"ipc://{tmp}/peer"
        first = ctx.socket(zmq.ROUTER)
        first.bind(endpoint)
        replies: asyncio.Queue = asyncio.Queue()
        dealer = DealerSocket(endpoint, replies.put_nowait)
        dealer.connect()
        try:
            m1 = codec.encode(np.full(MiB // 4, 1.0, np.float32), pool)
            h1 = _handle_of(m1)
            assert dealer.send(m1) == 0
            for _ in range(500):  # the first process has it queued, unread, when it dies
                if first.poll(0, zmq.POLLIN):
                    break
                await asyncio.sleep(0.01)
            assert first.poll(0, zmq.POLLIN)
            first.close(linger=0)  # gone with the message in its queue
            await asyncio.sleep(0.2)  # libzmq's I/O thread ends its endpoint (and file) later
            second = ctx.socket(zmq.ROUTER)  # the replacement at the same endpoint
            second.bind(endpoint)
            m2 = codec.encode(np.full(MiB // 4, 2.0, np.float32), pool)
            h2 = _handle_of(m2)
            assert dealer.send(m2) == 1
            assert dealer.send([msgpack.packb("ping")]) == 2
            got = []
            for _ in range(2):
                assert await asyncio.to_thread(second.poll, 10_000)
                got.append(second.recv_multipart(copy=True))
            peer = got[0][0]
            view = codec.decode(got[0][1:], reader)  # the second process decodes m2 and keeps it
            assert float(view[0]) == 2.0 and _words(h2)[READER] >> 22 == _start_ticks(os.getpid())
            assert pool.busy() == 2
            second.send_multipart([peer, b"answer to message 2"])
            await asyncio.wait_for(replies.get(), 10)
            dealer.peer_read(2)
            # m1 never reached anybody: released; m2 is viewed by a live reader: kept
            assert _words(h1)[RELEASED] == _words(h1)[GENERATION] == 1
            assert _words(h2)[RELEASED] == 0 and pool.busy() == 1
            assert float(view[-1]) == 2.0
            del view
            gc.collect()
            assert pool.busy() == 0
            second.close(linger=0)
        finally:
            dealer.close()


def test_release_unread_skips_a_slot_refilled_since_or_stamped_by_a_reader():
    pool = ShmPool(64 * MiB, 64 << 10)
    frames = _sent(Codec().encode(np.ones(MiB // 4, np.float32), pool))
    handle = _handle_of(frames)
    _write_reader(handle, (_start_ticks(os.getpid()) << 22) | os.getpid())
    assert release_unread(frames[0].slots) == 0 and _words(handle)[RELEASED] == 0
    _write_reader(handle, 0)
    assert release_unread(frames[0].slots) == 1 and _words(handle)[RELEASED] == 1
    assert release_unread(frames[0].slots) == 0  # once


def test_a_receiver_forgets_the_mapping_of_a_slot_its_sender_closed():
    codec, reader = Codec(), ShmReader()
    old, new = ShmPool(64 * MiB, 64 << 10), ShmPool(64 * MiB, 64 << 10)
    codec.decode(_sent(codec.encode(np.ones(MiB // 4, np.float32), old)), reader)
    gc.collect()  # released
    new_frames = _sent(codec.encode(np.ones(MiB // 4, np.float32), new))  # its slot's fd is open now
    (old_key,) = reader._maps
    old.close()  # the free slot is closed: only the receiver's mapping still holds its memory
    view = codec.decode(new_frames, reader)
    assert list(reader._maps) == [(os.getpid(), _handle_of(new_frames)[1])] != [old_key]
    assert float(view.sum()) == MiB // 4


async def test_a_discarded_message_is_released_at_once_and_never_sent(tmp_path):
    pool = ShmPool(64 * MiB, 64 << 10)
    frames = Codec().encode(np.ones(MiB // 4, np.float32), pool)
    handle = _handle_of(frames)
    keep = frames[0]  # alive: only discard() can release it before it is collected
    keep.discard()
    assert _words(handle)[RELEASED] == _words(handle)[GENERATION] == 1 and pool.busy() == 0
    dealer = DealerSocket(f"ipc://{tmp_path}/nobody", lambda frames: None)
    dealer.connect()
    try:
        with pytest.raises(TransportError, match="discarded"):
            dealer.send(frames)
    finally:
        dealer.close()
    sent = Codec().encode(np.ones(MiB // 4, np.float32), pool)
    mark_sent(sent)
    sent[0].discard()  # given to a socket already: the receiver's to release
    assert pool.busy() == 1


def test_idle_free_slots_close_and_a_long_busy_one_of_an_exited_reader_is_released_first(monkeypatch):
    pool = ShmPool(64 * MiB, 64 << 10)
    a, _ = pool.put(np.zeros(MiB, np.uint8))  # busy: decoded by a process that exited since
    b, _ = pool.put(np.zeros(MiB, np.uint8))
    assert pool.slot_bytes == 2 * MiB and pool.busy() == 2
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    gone_pid = next(p for p in range(min(pid_max, 1 << 22) - 1, 1, -1) if not os.path.exists(f"/proc/{p}"))
    _write_reader(a, (1 << 22) | gone_pid)

    def release_b(generation: int) -> None:  # b's reader is done with it
        fd = os.open(f"/proc/{b[0]}/fd/{b[1]}", os.O_RDWR)
        os.pwrite(fd, generation.to_bytes(8, "little"), 8 * RELEASED)
        os.close(fd)

    release_b(1)
    again, _ = pool.put(np.zeros(MiB, np.uint8))  # b again; a is not idle yet: it stays
    assert again[1] == b[1] and pool.slot_bytes == 2 * MiB and _words(a)[RELEASED] == 0
    release_b(2)
    monkeypatch.setattr("replayrl.transport.shm_pool.IDLE_SLOT_SECONDS", 0.0)
    _, (slot, _) = pool.put(np.zeros(MiB, np.uint8))
    assert pool.slot_bytes == MiB and pool.busy() == 1  # only the slot just filled is left
    assert slot.fd == b[1]
