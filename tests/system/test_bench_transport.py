"""``replayrl bench transport``'s floor rows (docs/design/transport.md#shm-transport):
the overhead arithmetic against hand-computed values, and the socket-level floor
measured with tiny counts (figures positive and finite; no timed assertion)."""
from __future__ import annotations

import math
import re

from replayrl.tools.bench import transport as bt


def test_overhead_row_by_hand():
    # 1 MiB: memcpy at 1 MiB / 20 us, frames 1 MiB / 500 us, shared memory 1 MiB / 100 us
    nbytes = 1 << 20
    row = bt.overhead_row("1 MiB", nbytes, nbytes / 20e-6, nbytes / 500e-6, nbytes / 100e-6)
    assert "memcpy 20.0 us" in row
    assert "ZeroMQ frames +480.0 us" in row
    assert "shared memory +80.0 us" in row
    assert "0.9x memcpy allows +2.2 us" in row  # 20 us / 0.9 = 22.2 us per message


def test_floor_rows_by_hand():
    rows = bt.floor_rows(bt.SocketFloor(asyncio_both=135e-6, raw_client=95e-6, raw_server=76e-6), 50e-6)
    assert [re.search(r"\| (\d+) us \| ([\d.]+)x raw zmq \|$", r).groups() for r in rows] == [
        ("135", "2.70"), ("95", "1.90"), ("76", "1.52")]
    assert "no codec, no actor" in rows[0]
    assert "raw pyzmq client -> asyncio" in rows[1] and "asyncio socket client -> raw pyzmq" in rows[2]


def test_floor_and_overhead_measured_with_tiny_counts(tmp_path):
    run_dir = tmp_path / "ipc"
    run_dir.mkdir(mode=0o700)
    floor = bt.socket_floor(str(run_dir), calls=20)
    raw_p50, _ = bt.raw_zmq_calls(bt.ipc_endpoint(str(run_dir), "raw.sock"), 20, 4)
    for seconds in (floor.asyncio_both, floor.raw_client, floor.raw_server, raw_p50):
        assert math.isfinite(seconds) and seconds > 0
    rows = bt.floor_rows(floor, raw_p50)
    assert len(rows) == 3
    for row in rows:
        us, ratio = re.search(r"\| (\d+) us \| ([\d.]+)x raw zmq \|$", row).groups()
        assert int(us) >= 0 and math.isfinite(float(ratio)) and float(ratio) > 0
    nbytes = bt.SIZES[bt._OVERHEAD_SIZE]
    memcpy = bt.memcpy_bytes_per_s(nbytes, 1)
    shm = bt.one_way_bytes_per_s(nbytes, True, 1)
    assert math.isfinite(memcpy) and memcpy > 0 and math.isfinite(shm) and shm > 0
    assert "shared memory +" in bt.overhead_row(bt._OVERHEAD_SIZE, nbytes, memcpy, shm, shm)
