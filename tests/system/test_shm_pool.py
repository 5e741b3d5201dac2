"""The shared-memory pool for large arrays between processes of one node (docs/design/transport.md#shm-transport):
values, slot lifetime, reuse, fallback to frames, refusal of
forged or stale handles and of handles from a tcp peer, and a live actor across processes."""
from __future__ import annotations

import asyncio
import gc
import os
import re
import tempfile

import msgpack
import numpy as np
import pytest
import torch

from replayrl.actors import ActorSpec, Directory, Supervisor
from replayrl.actors.ref import POOL, Message, shared_memory_pool, use_shared_memory
from replayrl.transport import Codec, CodecConfig, DealerSocket, DecodeError, MessageTooLarge, TransportError
from replayrl.transport.array_bundle import pack_arrays, unpack_arrays
from replayrl.transport.shm_pool import (
    DEFAULT_SHM_MIN_ARRAY_BYTES,
    DEFAULT_SHM_POOL_BYTES,
    ShmHeader,
    ShmPool,
    ShmReader,
    buffer_in_use,
    mark_sent,
    read_once,
    renew_buffer,
)

ECHO = "tests.actor_fixtures:EchoActor"
MiB = 1 << 20
FAULT_AROUND = 64 << 10  # Linux maps up to 16 pages around a read fault of a file page


def _sent(frames: list) -> list:
    mark_sent(frames)  # as a socket does once ZeroMQ has the message
    return frames


def _handle_message(handle: list, n: int, dtype: str = "float32") -> list:
    """Frames of one numpy array of ``n`` elements whose data is the shared-memory ``handle``,
    written with msgpack directly (not by the codec under test)."""
    payload = msgpack.packb([dtype, [n], handle], use_bin_type=True)
    return [msgpack.packb(msgpack.ExtType(1, payload), use_bin_type=True)]


def test_array_travels_by_handle_and_its_slot_lives_as_long_as_any_view():
    pool, reader, codec = ShmPool(64 * MiB, 64 << 10), ShmReader(), Codec()
    x = np.arange(MiB // 4, dtype=np.float32)  # 1 MiB
    frames = _sent(codec.encode({"x": x, "small": np.arange(3)}, pool))
    assert len(frames) == 1 and type(frames[0]) is ShmHeader  # no ZeroMQ frame for the array
    assert len(frames[0]) < 200  # the header carries a handle, not the megabyte
    x[:] = -1  # the sender's later write does not reach the message (copied at encode)
    y = codec.decode(frames, reader)["x"]
    np.testing.assert_array_equal(y, np.arange(MiB // 4, dtype=np.float32))
    assert not y.flags.writeable
    del frames
    view = y[10:].reshape(-1, 2)[::3]  # a view of a view: numpy collapses bases
    del y
    gc.collect()
    assert pool.busy() == 1  # still viewed: the sender may not reuse it
    assert view[0, 0] == 10.0
    del view
    gc.collect()
    assert pool.busy() == 0
    # the next message reuses the same slot (no new memory) and carries its own values
    z = codec.decode(_sent(codec.encode(np.full(MiB // 4, 7, np.float32), pool)), reader)
    assert float(z.sum()) == 7.0 * (MiB // 4) and pool.slot_bytes == MiB


def test_a_send_buffer_goes_whole_by_handle_once_and_its_slot_waits_for_both_sides():
    # the trainer's weight push: built in a slot, sent to the first engine without a copy
    pool, reader, codec = ShmPool(64 * MiB, 64 << 10), ShmReader(), Codec()
    buffer = pool.buffer(MiB).view(np.float32)
    buffer[:] = np.arange(MiB // 4, dtype=np.float32)
    assert pool.slot_bytes == MiB and pool.busy() == 1
    y = codec.decode(_sent(codec.encode({"w": buffer}, pool)), reader)["w"]
    assert pool.slot_bytes == MiB  # no second slot: the message is the buffer's slot
    np.testing.assert_array_equal(y, np.arange(MiB // 4, dtype=np.float32))
    # a second engine gets a copy in a slot of its own, whose values are the buffer's
    z = codec.decode(_sent(codec.encode(buffer, pool)), reader)
    assert pool.slot_bytes == 2 * MiB
    buffer[0] = -1.0  # a later write by the sender reaches neither copy of the second message
    assert z[0] == 0.0
    del z
    gc.collect()
    assert pool.busy() == 1
    del y  # the first receiver released it, the sender still holds the buffer
    gc.collect()
    assert pool.busy() == 1
    del buffer
    gc.collect()
    assert pool.busy() == 0
    # the released slot is taken again by the next send buffer of its size class
    again = pool.buffer(MiB)
    assert pool.slot_bytes == 2 * MiB and pool.busy() == 1
    del again
    gc.collect()
    assert pool.busy() == 0  # never sent: dropping it frees the slot


def test_a_renewed_send_buffer_goes_by_handle_again_once_its_receiver_released_it():
    # the trainer's weights live in a send buffer and every push sends it anew
    pool, reader, codec = ShmPool(64 * MiB, 64 << 10), ShmReader(), Codec()
    weights = pool.buffer(MiB).view(np.float32)
    weights[:] = 1.0
    assert not buffer_in_use(weights)  # never sent
    y = codec.decode(_sent(codec.encode(weights, pool)), reader)
    assert buffer_in_use(weights) and buffer_in_use(weights[10:])  # any view of it says so
    with pytest.raises(TransportError, match="may still read"):
        renew_buffer(weights)
    del y
    gc.collect()
    assert not buffer_in_use(weights)
    weights[:] = 2.0  # the owner's step
    renew_buffer(weights)
    z = codec.decode(_sent(codec.encode(weights, pool)), reader)
    assert pool.slot_bytes == MiB and float(z[0]) == 2.0  # by handle again: no new slot
    # an unsent message leaves it free for the owner
    del z
    gc.collect()
    renew_buffer(weights)
    codec.encode(weights, pool)  # dropped unsent
    gc.collect()
    assert not buffer_in_use(weights)
    with pytest.raises(TransportError, match="not a send buffer"):
        renew_buffer(np.zeros(MiB, np.uint8))
    assert not buffer_in_use(np.zeros(4))
    del weights
    gc.collect()
    assert pool.busy() == 0


def _resident_bytes(address: int) -> int:
    """Rss of this process's mapping that starts at ``address``, from /proc/self/smaps (bytes)."""
    inside = False
    for line in open("/proc/self/smaps"):
        header = re.match(r"([0-9a-f]+)-[0-9a-f]+ ", line)  # a mapping's first line: its range
        if header:
            inside = int(header.group(1), 16) == address
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_a_receiver_maps_a_large_slot_as_read_and_unmaps_it_on_release():
    # the engine's copy of a 50m weight push: its pages are the trainer's, counted once
    pool, reader, codec = ShmPool(256 * MiB, 64 << 10), ShmReader(), Codec()
    weights = pool.buffer(32 * MiB).view(np.float32)
    weights[:] = 1.0
    y = codec.decode(_sent(codec.encode(weights, pool)), reader)
    (mapping,) = reader._maps.values()
    # only the header page until read (and the kernel's fault-around of it: 64 KiB by default)
    assert _resident_bytes(mapping.address) <= FAULT_AROUND
    assert float(y[-1]) == 1.0 and float(y.sum()) == len(weights)  # read in place
    assert _resident_bytes(mapping.address) >= 32 * MiB
    del y
    gc.collect()
    assert _resident_bytes(mapping.address) <= 4096  # released: only the header page is left
    assert float(weights[-1]) == 1.0  # the sender's pages keep their contents
    weights[:] = 2.0
    renew_buffer(weights)
    z = codec.decode(_sent(codec.encode(weights, pool)), reader)
    np.testing.assert_array_equal(z[:: 1 << 16], np.full(len(weights) >> 16, 2.0, np.float32))
    del z
    gc.collect()
    # a small slot is mapped at once and stays mapped after its release (rollouts: many
    # messages, few pages)
    small = codec.decode(_sent(codec.encode(np.ones(MiB // 4, np.float32), pool)), reader)
    small_map = next(m for m in reader._maps.values() if m.capacity < 16 * MiB)
    assert _resident_bytes(small_map.address) >= MiB
    with read_once(small):  # not a large slot: nothing dropped
        pass
    del small
    gc.collect()
    assert _resident_bytes(small_map.address) >= MiB
    del weights
    gc.collect()


def test_read_once_holds_one_array_of_a_large_slot_at_a_time():
    # an engine loading a push array by array holds each array's pages for its copy only
    pool, reader, codec = ShmPool(256 * MiB, 64 << 10), ShmReader(), Codec()
    sizes = [3 * MiB + 12, 8 * MiB, 5, 6 * MiB - 4]  # bytes / 4: arrays not page aligned
    sent = {f"w{i}": np.arange(n // 4, dtype=np.float32) * (i + 1) for i, n in enumerate(sizes)}
    bundle = codec.decode(_sent(codec.encode(pack_arrays(sent), pool)), reader)
    arrays = unpack_arrays(bundle)
    (mapping,) = (m for m in reader._maps.values() if m.capacity >= 16 * MiB)
    for name, a in arrays.items():
        with read_once(a):
            copy = a.copy()
            resident = _resident_bytes(mapping.address)
        np.testing.assert_array_equal(copy, sent[name])
        # the array's pages, plus the kernel's fault-around at its ends and of the header page
        assert a.nbytes <= resident <= a.nbytes + 3 * FAULT_AROUND
        assert _resident_bytes(mapping.address) <= FAULT_AROUND
    np.testing.assert_array_equal(arrays["w2"], sent["w2"])  # read again: mapped again
    del arrays, bundle, a
    gc.collect()
    assert _resident_bytes(mapping.address) <= 4096
    assert pool.busy() == 0


def test_a_weight_push_loads_from_a_large_slot_one_array_at_a_time(monkeypatch):
    # load_state_arrays reads each pushed array inside read_once: the engine's resident pages of
    # the push never reach the push's size (measured at every array's copy)
    from replayrl.rollout.model import checkpoint as ckpt
    from replayrl.rollout.model.config import embedded_config
    from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM

    cfg = embedded_config(44, "10m")
    trainer_side = Qwen3MoeForCausalLM(cfg).eval()
    engine_side = Qwen3MoeForCausalLM(cfg).eval()
    pool, reader, codec = ShmPool(256 * MiB, 64 << 10), ShmReader(), Codec()
    push = ckpt.state_dict_arrays(trainer_side)
    arrays = unpack_arrays(codec.decode(_sent(codec.encode(pack_arrays(push), pool)), reader))
    (mapping,) = (m for m in reader._maps.values() if m.capacity >= 16 * MiB)
    largest = max(a.nbytes for a in arrays.values())
    seen = []
    inner = ckpt.read_once

    def measured(array):
        class Measured:
            def __enter__(self):
                self.context = inner(array)
                self.context.__enter__()

            def __exit__(self, *exc):  # after the copy: what it mapped
                seen.append(_resident_bytes(mapping.address))
                return self.context.__exit__(*exc)
        return Measured()

    monkeypatch.setattr(ckpt, "read_once", measured)
    ckpt.load_state_arrays(engine_side, arrays)
    assert len(seen) == len(push) and mapping.capacity > 16 * largest
    assert largest <= max(seen) <= largest + 3 * FAULT_AROUND
    assert _resident_bytes(mapping.address) <= FAULT_AROUND  # arrays still held, pages dropped
    for name, value in engine_side.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), push[name], err_msg=name)


def test_a_partial_or_offset_view_of_a_send_buffer_is_copied_and_small_ones_are_refused():
    pool, reader, codec = ShmPool(4 * MiB, 64 << 10), ShmReader(), Codec()
    buffer = pool.buffer(MiB)
    buffer[:] = np.arange(MiB, dtype=np.int64).astype(np.uint8)
    tail = codec.decode(_sent(codec.encode(buffer[MiB // 2:], pool)), reader)  # not from byte 0
    np.testing.assert_array_equal(tail, (np.arange(MiB // 2, MiB) % 256).astype(np.uint8))
    assert pool.slot_bytes == MiB + MiB // 2  # a slot of its own (a power of two below 16 MiB)
    whole = codec.decode(_sent(codec.encode(buffer, pool)), reader)  # still handed over whole
    assert pool.slot_bytes == MiB + MiB // 2 and whole[MiB - 1] == 255
    assert pool.buffer(1000) is None  # below min_array_bytes: the caller allocates
    assert pool.buffer(8 * MiB) is None  # beyond max_bytes


def test_send_buffer_falls_back_to_an_ordinary_array_without_a_pool():
    from replayrl.actors import send_buffer

    use_shared_memory(0, 64 << 10)
    try:
        plain = send_buffer(MiB, np.float32)
        assert plain.dtype == np.float32 and plain.shape == (MiB,) and plain.base is None
    finally:
        use_shared_memory(DEFAULT_SHM_POOL_BYTES, DEFAULT_SHM_MIN_ARRAY_BYTES)
    in_pool = send_buffer(MiB, np.float32)
    assert in_pool.shape == (MiB,) and in_pool.base is not None
    assert shared_memory_pool().busy() >= 1
    with pytest.raises(ValueError, match="size"):
        send_buffer(-1)


def test_a_large_array_takes_a_slot_at_most_an_eighth_larger_than_itself():
    # 20 MiB + 1 byte: the next power of two (32 MiB) would be resident in the sender and in
    # the receiver; from 16 MiB the slots come in steps of 1/8 of the power of two (2 MiB here)
    pool, reader, codec = ShmPool(256 * MiB, 64 << 10), ShmReader(), Codec()
    x = np.arange(20 * MiB + 1, dtype=np.uint8)
    y = codec.decode(_sent(codec.encode(x, pool)), reader)
    np.testing.assert_array_equal(y, x)
    assert pool.slot_bytes == 22 * MiB
    del y
    gc.collect()
    # the same size again reuses the slot; 15 MiB still takes a power of two
    codec.decode(_sent(codec.encode(x, pool)), reader)
    codec.decode(_sent(codec.encode(np.zeros(15 * MiB, np.uint8), pool)), reader)
    assert pool.slot_bytes == 22 * MiB + 16 * MiB


def test_torch_tensors_and_tensor_data_through_shared_memory():
    pool, reader, codec = ShmPool(64 * MiB, 64 << 10), ShmReader(), Codec()
    t = torch.arange(300_000, dtype=torch.float32).to(torch.bfloat16)  # 600 KB
    back = codec.decode(_sent(codec.encode(t, pool)), reader)
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    del back
    gc.collect()
    assert pool.busy() == 0


def test_unsent_and_unencodable_messages_release_their_slots():
    pool, codec = ShmPool(64 * MiB, 64 << 10), Codec()
    frames = codec.encode(np.ones(MiB, np.uint8), pool)
    assert pool.busy() == 1
    del frames  # never sent: a refused argument check, a closed socket, a cancelled caller
    gc.collect()
    assert pool.busy() == 0
    with pytest.raises(TransportError):  # the second array's dtype is refused mid-encode
        codec.encode([np.ones(MiB, np.uint8), np.array(["s"])], pool)
    gc.collect()
    assert pool.busy() == 0


def test_a_full_pool_falls_back_to_frames_and_small_arrays_stay_inline():
    pool, reader, codec = ShmPool(MiB, 64 << 10), ShmReader(), Codec()
    a = codec.decode(_sent(codec.encode(np.ones(MiB // 4, np.float32), pool)), reader)  # the one slot
    frames = _sent(codec.encode(np.full(MiB // 4, 2, np.float32), pool))  # no room: a frame
    assert len(frames) == 2 and type(frames[0]) is bytes
    assert float(codec.decode(frames, reader).sum()) == 2.0 * (MiB // 4)
    assert len(codec.encode(np.ones(1000, np.float32), pool)) == 1 and pool.busy() == 1  # inline
    frames = codec.encode(np.ones(32 << 10, np.uint8), pool)  # under min_array_bytes: a frame
    assert len(frames) == 2 and type(frames[0]) is bytes
    del a
    gc.collect()
    assert pool.busy() == 0


def test_handles_are_refused_without_a_reader_and_when_forged_or_stale(tmp_path):
    pool, reader, codec = ShmPool(64 * MiB, 64 << 10), ShmReader(), Codec()
    frames = _sent(codec.encode(np.ones(MiB // 4, np.float32), pool))
    with pytest.raises(DecodeError, match="only from an ipc peer"):
        codec.decode(frames)  # a tcp peer's message: no reader
    handle = msgpack.unpackb(msgpack.unpackb(bytes(frames[0])).data)[2]
    pid, fd, token, generation = handle
    n = MiB // 4
    with pytest.raises(DecodeError, match="token"):
        codec.decode(_handle_message([pid, fd, token + 1, generation], n), reader)
    with pytest.raises(DecodeError, match="stale"):
        codec.decode(_handle_message([pid, fd, token, generation + 1], n), reader)
    with pytest.raises(DecodeError, match="does not fit"):
        codec.decode(_handle_message(handle, 2 * n), reader)  # 2 MiB from a 1 MiB slot
    with pytest.raises(MessageTooLarge):
        Codec(CodecConfig(max_message_bytes=MiB)).decode(_handle_message(handle, n + 1), reader)
    with pytest.raises(DecodeError, match="cannot be opened"):
        codec.decode(_handle_message([pid, 999_999, token, generation], n), reader)
    with open(tmp_path / "plain", "wb") as f:  # an fd that is a file, not a pool slot
        with pytest.raises(DecodeError, match="not a replayrl pool slot"):
            codec.decode(_handle_message([os.getpid(), f.fileno(), 1, 1], n), reader)
    for bad in ([pid, fd, token], [pid, fd, "t", generation], [-1, fd, token, generation], [pid, -3, 1, 1]):
        with pytest.raises(DecodeError, match=r"\[pid, fd, token, generation\]"):
            codec.decode(_handle_message(bad, n), reader)
    np.testing.assert_array_equal(codec.decode(frames, reader), np.ones(n, np.float32))  # still fine


def test_only_ipc_peers_get_handles_and_the_settings_switch_the_pool_off():
    args = (np.ones(MiB, np.uint8),)
    assert type(Message.of("call", "m", args, {}, "ipc:///tmp/x/a").frames[0]) is ShmHeader
    tcp = Message.of("call", "m", args, {}, "tcp://127.0.0.1:5555").frames
    assert len(tcp) == 2 and type(tcp[0]) is bytes  # another host: an ordinary frame
    saved = POOL.shm
    try:
        use_shared_memory(0, 1)
        assert shared_memory_pool() is None
        assert len(Message.of("call", "m", args, {}, "ipc:///tmp/x/a").frames) == 2
        with pytest.raises(TransportError, match="min_array_bytes"):
            use_shared_memory(1 << 20, 0)
    finally:
        POOL.shm = saved


def test_directory_carries_the_pool_settings(tmp_path):
    directory = Directory.for_run(tmp_path, ["a"], shm=(123 * MiB, 4096))
    directory.save(tmp_path / "d.json")
    assert Directory.load(tmp_path / "d.json").shm == (123 * MiB, 4096)


async def test_live_actor_receives_and_returns_arrays_through_shared_memory():
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:  # short: AF_UNIX path limit
        directory = Directory.for_run(run_dir, ["a"])
        async with Supervisor([ActorSpec("a", ECHO, {})], directory, run_dir):
            ref = directory.ref("a")
            x = np.random.default_rng(0).standard_normal(MiB, dtype=np.float32)  # 4 MiB
            assert await ref.call("total", x) == float(x.astype(np.float64).sum())
            back = await ref.call("echo", x)
            np.testing.assert_array_equal(back, x)
            assert type(back.base).__name__ == "_Lease"  # a view of the actor's slot
            # the actor's slot for its reply stays busy while we hold the view; its own
            # receive slot was released, so our pool has nothing busy
            gc.collect()
            assert shared_memory_pool().busy() == 0
            del back
            gc.collect()
            for _ in range(3):  # the released slot is reused, so the values are fresh ones
                y = np.full(MiB, 3.0, np.float32)
                assert float((await ref.call("echo", y)).sum()) == 3.0 * MiB
            # a forged handle from an ipc peer: an error reply naming it, and the actor serves on
            array = msgpack.ExtType(1, msgpack.packb(["float32", [4], [os.getpid(), 999_999, 1, 1]]))
            forged = msgpack.packb({"k": "call", "id": 9, "m": "total", "a": [array], "kw": {}})
            replies: asyncio.Queue = asyncio.Queue()
            raw = DealerSocket(directory.endpoint("a"), replies.put_nowait)
            raw.connect()
            try:
                raw.send([forged])
                reply = Codec().decode(await asyncio.wait_for(replies.get(), 30))
            finally:
                raw.close()
            assert reply["k"] == "err" and reply["id"] == 9 and reply["t"] == "DecodeError"
            assert "fd/999999 cannot be opened" in reply["msg"]
            assert await ref.call("echo", 5, timeout=30) == 5
