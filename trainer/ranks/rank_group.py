"""The trainer ranks' process group and how a batch is split over the data-parallel ranks.

With ``--dp-size N > 1`` the trainer is ``N`` processes (docs/design/trainer-ranks.md#trainer-ranks):
rank 0 is the ``trainer`` actor, ranks ``1 .. N-1`` are ``trainer_1 .. trainer_{N-1}``. They
join one torch.distributed process group of their own (a TCP store at ``host:port`` that rank
0 serves, so the same code runs under the single-node launcher and under torchrun, whose world also holds the
driver and the engines). The group's device backend is ``cpu:gloo,cuda:nccl`` where CUDA and
NCCL exist (CPU tensors over gloo, CUDA tensors over NCCL), else ``gloo``. With one rank
nothing here runs.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence, TypeVar

from replayrl.trainer.errors import RankGroupError

__all__ = ["RankGroup", "follower_names", "shard_bounds", "shard"]

T = TypeVar("T")


def follower_names(size: int) -> list[str]:
    """Actor names of trainer ranks ``1 .. size-1``: ``trainer_1 .. trainer_{size-1}``."""
    return [f"trainer_{r}" for r in range(1, size)]


@dataclass(frozen=True)
class RankGroup:
    """Where and as what one trainer rank joins the trainer ranks' process group.

    Attributes:
        rank: this process's rank, ``0 <= rank < size`` (0 = the ``trainer`` actor).
        size: trainer ranks (``--dp-size`` times the model-parallel size of the backend).
        host, port: the rendezvous: the TCP store rank 0 serves there.
        timeout_s: seconds a collective (and the rendezvous) may wait for the other ranks
            before it raises; a rank that died ends its peers' step this way.
    """

    rank: int
    size: int
    host: str
    port: int
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1):
            raise RankGroupError(f"RankGroup.size must be an int >= 1, got {self.size!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise RankGroupError(f"RankGroup.rank must be in [0, {self.size}), got {self.rank!r}")
        if not (isinstance(self.port, int) and 0 < self.port < 65536):
            raise RankGroupError(f"RankGroup.port must be a TCP port, got {self.port!r}")

    def join(self) -> None:
        """Initialise torch.distributed's default group over the trainer ranks (blocks until
        all ``size`` ranks joined, at most ``timeout_s``).

        Raises:
            RuntimeError / DistNetworkError (from torch): the rendezvous timed out or the port
                is taken.
        """
        import torch
        import torch.distributed as dist

        gpu = torch.cuda.is_available() and dist.is_nccl_available()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # a store of our own: under torchrun a tcp:// or env:// init_method would reuse the
        # elastic agent's store, whose world is every process of the run, not these ranks
        store = dist.TCPStore(self.host, self.port, world_size=self.size,
                              is_master=self.rank == 0, timeout=timeout)
        dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo", store=store,
                                rank=self.rank, world_size=self.size, timeout=timeout)


def shard_bounds(count: int, dp_size: int, *, exact: bool) -> list[tuple[int, int]]:
    """``[start, stop)`` of each data-parallel rank's contiguous share of ``count`` items.

    Args:
        count: items (samples) in the batch.
        dp_size: data-parallel ranks.
        exact: every rank must get the same number (a training step: every rank runs the same
            number of microbatches, each backward a collective); otherwise the first
            ``count % dp_size`` ranks get one more (a preflight, which has no collective over
            data-parallel ranks).
    Returns:
        ``dp_size`` pairs, in rank order, covering ``0 .. count`` without overlap.
    Raises:
        RankGroupError: ``exact`` and ``count`` is not a multiple of ``dp_size``.
    """
    if exact and count % dp_size:
        raise RankGroupError(f"a batch of {count} samples does not split evenly over "
                             f"--dp-size {dp_size} trainer ranks")
    base, extra = divmod(count, dp_size)
    bounds, start = [], 0
    for r in range(dp_size):
        stop = start + base + (r < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard(items: Sequence[T], dp_size: int, *, exact: bool) -> list[list[T]]:
    """``items`` cut into ``dp_size`` contiguous shares by :func:`shard_bounds`."""
    return [list(items[a:b]) for a, b in shard_bounds(len(items), dp_size, exact=exact)]
