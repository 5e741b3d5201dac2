"""Where each torchrun rank's actors listen: the rank's own address, exchanged through torchrun's
rendezvous store (docs/design/multi-host.md#attach-and-multi-host).

A rank listens on the address its host uses to reach ``MASTER_ADDR`` (the source address the
kernel picks for that route: on one node ``127.0.0.1``, across nodes the interface facing the
master), and publishes it under ``replayrl/host/<rank>`` in the store that torchrun's env://
rendezvous gives every rank (the elastic agent's TCPStore at ``MASTER_ADDR:MASTER_PORT``). No
process group is created: the trainer's own ``torch.distributed`` world (megatron, DP) stays
its own business.

Joined engines (:func:`join_run`): an engine host the run should survive losing runs its own
one-node torchrun (``--join-run MASTER_ADDR:MASTER_PORT``), outside the run's torchrun world, so
no agent of that world waits for it or is torn down with it (docs/design/multi-host.md#attach-and-multi-host).
Its ranks reach the same store as plain TCPStore clients, take a slot with an
atomic counter (``replayrl/joined``) and publish under ``replayrl/host/joined-<slot>``; rank 0 of
the run publishes the run's world size and joined-engine count (``replayrl/plan``) so every
joined rank builds the same plan, and the run's settings (``replayrl/settings``, its
``config.json``) so a joined rank can refuse to join a run it would not fit.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

from replayrl.tools.errors import RendezvousError

__all__ = ["own_address", "exchange_addresses", "join_run", "JoinedRank"]

_PLAN_KEY = "replayrl/plan"  # "<world size> <joined engines>", set by rank 0 of the run
_SLOT_KEY = "replayrl/joined"  # counter: joined ranks so far
_SETTINGS_KEY = "replayrl/settings"  # the run's RunConfig.to_json(), set by rank 0 before the plan


def _host_keys(world_size: int, joined: int) -> list[str]:
    """The store keys (under ``replayrl/host/``) of the run's ranks, then its joined engines."""
    return [str(r) for r in range(world_size)] + [f"joined-{j}" for j in range(joined)]


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


def exchange_addresses(rank: int, world_size: int, address: str, timeout_s: float,
                       joined: int = 0, settings: str = "") -> list[str]:
    """Publish this rank's ``address`` and return every rank's, in rank order, followed by the
    ``joined`` engines' (:func:`join_run`) in slot order.

    Uses ``torch.distributed.rendezvous("env://")`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE`` as torchrun sets them; under torchrun the agent hosts the store). Rank 0 also
    publishes the run's ``settings`` (JSON text) and the plan joined ranks read (``world_size``,
    ``joined``).

    Raises:
        RendezvousError: a rank or joined engine did not publish within ``timeout_s`` seconds
            (names the missing ones), or the store cannot be reached.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        if rank == 0:
            store.set(_SETTINGS_KEY, settings)  # before the plan, which joined ranks wait for
            store.set(_PLAN_KEY, f"{world_size} {joined}")
        return _publish_and_wait(dist.PrefixStore("replayrl/host/", store), str(rank), address,
                                 _host_keys(world_size, joined), timeout)
    except (RuntimeError, ValueError, OSError) as exc:
        raise RendezvousError(f"rank {rank}: exchanging actor addresses through the rendezvous "
                              f"store failed (joined engines expected: {joined}): "
                              f"{type(exc).__name__}: {exc}") from None


def _publish_and_wait(store, key: str, address: str, keys: list[str],
                      timeout: timedelta) -> list[str]:
    store.set(key, address)
    try:
        store.wait(keys, timeout)
    except RuntimeError:  # torch's DistStoreError: the timeout; name who never came
        missing = [("joined engine " + k.removeprefix("joined-")) if k.startswith("joined-")
                   else f"rank {k}" for k in keys if not store.check([k])]
        if not missing:
            raise
        raise RendezvousError(f"no address from {', '.join(missing)} within "
                              f"{timeout.total_seconds():g} s") from None
    return [store.get(k).decode() for k in keys]


@dataclass(frozen=True)
class JoinedRank:
    """What a joined engine rank learnt from the run's store.

    Attributes:
        slot: this rank's joined-engine index, ``0 <= slot < joined`` (order of arrival).
        world_size: ranks of the run's own torchrun world.
        joined: joined engines the run expects (``--joined-engines``).
        addresses: the run's ranks' addresses in rank order, then the joined engines' in slot
            order (as :func:`exchange_addresses` returns them).
    """

    slot: int
    world_size: int
    joined: int
    addresses: list[str]


def join_run(host: str, port: int, address: str, timeout_s: float,
             check: Callable[[str], None] | None = None) -> JoinedRank:
    """Take a joined-engine slot in the run whose torchrun store is at ``host:port`` (its
    ``MASTER_ADDR`` / ``MASTER_PORT``), publish ``address`` under it and wait for every rank's
    and joined engine's address.

    ``check`` is called with the run's settings (rank 0's JSON text) before this rank publishes
    its address; what it raises propagates and the rank never joins.

    Raises:
        RendezvousError: the store cannot be reached, the run's rank 0 did not publish its plan
            within ``timeout_s`` seconds, more engines joined than the run expects (names the
            slot and ``--joined-engines``), or an address is missing after ``timeout_s``.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        slot = store.add(_SLOT_KEY, 1) - 1
        store.wait([_PLAN_KEY], timeout)
        world_size, joined = (int(v) for v in store.get(_PLAN_KEY).decode().split())
        if slot >= joined:
            raise RendezvousError(f"joined engine slot {slot} at {host}:{port}: the run expects "
                                  f"--joined-engines {joined}; start no more joined ranks than that")
        settings = store.get(_SETTINGS_KEY).decode() if store.check([_SETTINGS_KEY]) else ""
    except RendezvousError:
        raise
    except (RuntimeError, ValueError, OSError) as exc:
        raise RendezvousError(f"joining the run at {host}:{port} through its rendezvous store "
                              f"failed: {type(exc).__name__}: {exc}") from None
    if check is not None:
        check(settings)
    try:
        addresses = _publish_and_wait(dist.PrefixStore("replayrl/host/", store), f"joined-{slot}",
                                      address, _host_keys(world_size, joined), timeout)
        return JoinedRank(slot, world_size, joined, addresses)
    except RendezvousError:
        raise
    except (RuntimeError, ValueError, OSError) as exc:
        raise RendezvousError(f"joining the run at {host}:{port} through its rendezvous store "
                              f"failed: {type(exc).__name__}: {exc}") from None
