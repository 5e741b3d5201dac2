"""Read back an offline Weights & Biases run (``<dir>/wandb/offline-run-*/run-*.wandb``): its
config and its history rows, for the tests of ``--use-wandb``.

The ``.wandb`` file is W&B's transaction log: a 7-byte header (``:W&B``, magic, version), then
records in 32 KiB blocks (a block's tail shorter than a record header is padding), each record
a header ``<IHB`` (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes; a
whole record is one serialized ``wandb.proto.wandb_internal_pb2.Record``. Written here rather
than imported because wandb no longer ships its reader.
"""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: Path) -> list:
    """Every ``Record`` of one ``.wandb`` file, in order.

    Raises:
        ValueError: not a W&B transaction log, or a record of an unknown type.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    pos, out, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            whole = chunk if kind == 1 else pending + chunk
            record = pb.Record()
            record.ParseFromString(whole)
            out.append(record)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        else:
            raise ValueError(f"{path}: record of unknown type {kind} at byte {pos}")
    return out


def offline_run(directory: Path, wait_s: float = 30.0) -> tuple[dict, list[dict]]:
    """``(config, history rows)`` of the one offline run under ``directory/wandb``; each row
    maps a key to its JSON value (W&B's own ``_step``, ``_runtime``, ``_timestamp`` included).

    ``run.finish()`` can return before wandb's service process has written the file out, so
    this waits (up to ``wait_s`` seconds) for the run's ``exit`` record, its last.

    Raises:
        AssertionError: not exactly one offline run there, or no ``exit`` record in time.
    """
    files = sorted((Path(directory) / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline W&B run under {directory}/wandb, got {files}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            found = records(files[0])
        except Exception:  # a record cut off mid-write
            found = []
        if any(r.WhichOneof("record_type") == "exit" for r in found):
            break
        assert time.monotonic() < deadline, f"{files[0]}: no exit record after {wait_s} s"
        time.sleep(0.1)
    config: dict = {}
    rows: list[dict] = []
    for record in found:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item})
    config.pop("_wandb", None)
    return config, rows
