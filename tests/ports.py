"""Loopback TCP ports for the tests' torchrun runs, away from other tests' ports.

A torchrun run of replayrl listens on MASTER_PORT and the ports after it (actor ``i`` on
``MASTER_PORT + 1 + i``, the trainer's process group after them). A MASTER_PORT that the OS
picked (``bind(("127.0.0.1", 0))``) lies in the ephemeral range, where the OS also hands out the
ports of every other test's connections and ``bind(0)`` picks, so under two pytest-xdist
workers a port after it was taken at times ("cannot bind ... Address already in use"). The
ports here are drawn below the ephemeral range, and every one of the block was free when drawn.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def port_block(count: int = 32) -> int:
    """The first of ``count`` consecutive loopback ports, each free a moment ago, below the OS's
    ephemeral range.

    Raises:
        RuntimeError: no free block found in 200 draws.
    """
    high = _ephemeral_low() - count
    for _ in range(200):
        base = random.randrange(_LOWEST, high)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} free consecutive loopback ports below {high + count}")
