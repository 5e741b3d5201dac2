"""Where each torchrun rank's actors listen: the rank's own address, exchanged through torchrun's
rendezvous store (docs/design.md §21 "REPL attach and multi-host runs").

A rank listens on the address its host uses to reach ``MASTER_ADDR`` (the source address the
kernel picks for that route: on one node ``127.0.0.1``, across nodes the interface facing the
master), and publishes it under ``replayrl/host/<rank>`` in the store that torchrun's env://
rendezvous gives every rank (the elastic agent's TCPStore at ``MASTER_ADDR:MASTER_PORT``). No
process group is created: the trainer's own ``torch.distributed`` world (megatron, DP) stays
its own business.
"""
from __future__ import annotations

import socket
from datetime import timedelta

__all__ = ["own_address", "exchange_addresses", "RendezvousError"]


class RendezvousError(RuntimeError):
    """The ranks could not exchange their addresses (names the rank and the master)."""


def own_address(master_addr: str, master_port: int) -> str:
    """The local IP address this host uses to reach ``master_addr`` (no packet is sent: a UDP
    socket's ``connect`` only picks the route and its source address).

    Raises:
        RendezvousError: ``master_addr`` does not resolve or no route leads to it.
    """
    try:
        family, _, _, _, address = socket.getaddrinfo(master_addr, master_port,
                                                      type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as exc:
        raise RendezvousError(f"MASTER_ADDR={master_addr}: no route to it from this host: "
                              f"{exc}") from None


def exchange_addresses(rank: int, world_size: int, address: str, timeout_s: float) -> list[str]:
    """Publish this rank's ``address`` and return every rank's, in rank order.

    Uses ``torch.distributed.rendezvous("env://")`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE`` as torchrun sets them; under torchrun the agent hosts the store).

    Raises:
        RendezvousError: a rank did not publish within ``timeout_s`` seconds, or the store
            cannot be reached.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore("replayrl/host/", store)
        store.set(str(rank), address)
        keys = [str(r) for r in range(world_size)]
        store.wait(keys, timeout)
        return [store.get(k).decode() for k in keys]
    except (RuntimeError, ValueError, OSError) as exc:
        raise RendezvousError(f"rank {rank}: exchanging actor addresses through the rendezvous "
                              f"store failed: {type(exc).__name__}: {exc}") from None
