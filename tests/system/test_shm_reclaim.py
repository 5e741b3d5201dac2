"""A slot decoded by another process (docs/design/transport.md#shm-transport): never rewritten
while that process lives and holds a view of it, taken back by the next send once it was
SIGKILLed. Header words and the reader's start time are read here from /proc directly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgpack
import numpy as np

from replayrl.transport import Codec
from replayrl.transport.shm_pool import ShmPool, mark_sent

MiB = 1 << 20
N = MiB // 4  # float32 elements of one 1 MiB message

READER = """
import sys
import numpy as np
from replayrl.transport import Codec
from replayrl.transport.shm_pool import ShmReader
view = Codec().decode([bytes.fromhex(sys.stdin.readline())], ShmReader())
print(float(view.astype(np.float64).sum()), flush=True)
for line in sys.stdin:  # each line: check the values again
    print(float(view.astype(np.float64).sum()), flush=True)
"""


def _words(pid: int, fd: int) -> list[int]:
    f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    try:
        raw = os.pread(f, 40, 0)
    finally:
        os.close(f)
    return [int.from_bytes(raw[i:i + 8], "little") for i in range(0, 40, 8)]  # token .. reader


def test_a_live_reader_keeps_its_slot_and_a_killed_one_gives_it_back_to_the_next_send():
    pool = ShmPool(64 * MiB, 64 << 10)
    frames = Codec().encode(np.full(N, 5.0, np.float32), pool)
    mark_sent(frames)
    # the handle [pid, fd, token, generation] the codec's array ext carries
    fd = msgpack.unpackb(bytes(frames[0]), ext_hook=lambda code, data: msgpack.unpackb(data))[2][1]
    child = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        child.stdin.write(bytes(frames[0]).hex() + "\n")
        child.stdin.flush()
        assert float(child.stdout.readline()) == 5.0 * N
        start = int(open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[19])
        token, capacity, generation, released, reader = _words(os.getpid(), fd)
        assert (capacity, generation, released) == (MiB, 1, 0)
        assert reader == (start << 22) | child.pid  # the reader wrote its pid and start time
        for value in range(1, 6):  # sends while it holds the view: always another slot
            placed = pool.put(np.full(MiB, value, np.uint8))
            assert placed is not None and placed[0][1] != fd
        assert pool.slot_bytes == 6 * MiB
        child.stdin.write("check\n")
        child.stdin.flush()
        assert float(child.stdout.readline()) == 5.0 * N  # its view was never rewritten
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        assert _words(os.getpid(), fd)[3] == 0  # still busy: only the sender takes it back
        placed = pool.put(np.full(MiB, 9, np.uint8))
        assert placed is not None and placed[0][1] == fd and pool.slot_bytes == 6 * MiB
        assert _words(os.getpid(), fd)[2:] == [2, 1, 0]  # generation 2, released 1, no reader yet
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
