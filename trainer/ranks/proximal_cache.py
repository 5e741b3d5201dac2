"""Proximal logprobs of one step, held in host memory between preflight and update.

The preflight forward runs at the weights the optimizer step starts from; its per-token
logprobs are the proximal policy of decoupled PPO (Hilton et al. 2022) and the numerator of
the RS / TIS ratios. They wait on the trainer rank in host memory under a byte cap: page-locked
where the trainer computes on a CUDA device (the copies from and to the device are then
asynchronous, ``non_blocking``), ordinary pageable memory on the CPU, where pinning gives
nothing (:func:`replayrl.actors.device.pins_host_memory`; a CPU-only torch cannot pin at all).
"""
from __future__ import annotations

import torch

from replayrl.actors.device import pins_host_memory
from replayrl.trainer.errors import ProximalCacheError


class ProximalLogprobCache:
    """``sample_id -> float32 [R]`` proximal logprobs on the host, pinned for a CUDA trainer.

    Args:
        max_bytes: cap on the tensor payload (``--rs-refill-max-candidate-cache-bytes``).
        device: the trainer's device (default the CPU): a CUDA device makes the entries
            page-locked (:attr:`pinned`) and the copies into them asynchronous; every read
            (:meth:`take`, :meth:`peek`) first waits for the copies still in flight.
    """

    def __init__(self, max_bytes: int = 1 << 30, device: torch.device | None = None) -> None:
        self.max_bytes = max_bytes
        self.device = torch.device("cpu") if device is None else device
        self.pinned = pins_host_memory(self.device)
        self._in_flight = False  # a non_blocking device-to-host copy not yet waited for
        self.entries: dict[int, torch.Tensor] = {}
        self.nbytes = 0
        self.peak_bytes = 0
        self.transferred_bytes = 0

    def put(self, sample_id: int, logprobs: torch.Tensor) -> None:
        """Store a host copy of ``logprobs`` (float32 [R], on the CPU or the trainer's device)
        for ``sample_id``; from a CUDA tensor into pinned memory the copy is asynchronous.

        Raises:
            ProximalCacheError: duplicate sample id, or the byte cap would be exceeded.
        """
        if sample_id in self.entries:
            raise ProximalCacheError(f"sample {sample_id} is already cached")
        size = logprobs.numel() * 4
        if self.nbytes + size > self.max_bytes:
            raise ProximalCacheError(f"sample {sample_id}: cache would hold {self.nbytes + size} "
                                     f"bytes, over its cap of {self.max_bytes}")
        host = torch.empty(logprobs.shape, dtype=torch.float32, pin_memory=self.pinned)
        asynchronous = self.pinned and logprobs.device.type == "cuda"
        host.copy_(logprobs.detach(), non_blocking=asynchronous)
        self._in_flight = self._in_flight or asynchronous
        self.entries[sample_id] = host
        self.nbytes += size
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def take(self, sample_ids: list[int]) -> list[torch.Tensor]:
        """Remove and return the entries of ``sample_ids`` in order.

        Raises:
            ProximalCacheError: a sample is not cached or is asked for twice (nothing is
                removed then).
        """
        if len(set(sample_ids)) != len(sample_ids):
            dup = sorted({s for s in sample_ids if sample_ids.count(s) > 1})
            raise ProximalCacheError(f"samples requested twice from the proximal cache: {dup[:8]}")
        missing = [s for s in sample_ids if s not in self.entries]
        if missing:
            raise ProximalCacheError(f"samples not in the proximal cache: {missing[:8]}")
        self._wait()
        out = [self.entries.pop(s) for s in sample_ids]
        moved = sum(t.numel() * 4 for t in out)
        self.nbytes -= moved
        self.transferred_bytes += moved
        return out

    def peek(self, sample_id: int) -> torch.Tensor:
        """The cached logprobs of ``sample_id`` without removing them (read by the RS gate).

        Raises:
            ProximalCacheError: not cached.
        """
        try:
            entry = self.entries[sample_id]
        except KeyError:
            raise ProximalCacheError(f"sample {sample_id} is not in the proximal cache") from None
        self._wait()
        return entry

    def _wait(self) -> None:
        """Wait for the asynchronous copies :meth:`put` started (none on the CPU)."""
        if self._in_flight:
            torch.cuda.synchronize(self.device)
            self._in_flight = False

    def discard(self, sample_ids: list[int]) -> None:
        """Drop entries that will not be trained on (rejected or surplus groups)."""
        for s in sample_ids:
            entry = self.entries.pop(s, None)
            if entry is not None:
                self.nbytes -= entry.numel() * 4

    def check_bijection(self, sample_ids: list[int]) -> None:
        """Raise unless the cache holds exactly one entry per training sample and nothing else.

        Raises:
            ProximalCacheError: naming missing, duplicate or extra sample ids.
        """
        wanted = set(sample_ids)
        problems = []
        if len(wanted) != len(sample_ids):
            problems.append(f"duplicate training samples {sorted(s for s in wanted if sample_ids.count(s) > 1)[:8]}")
        if missing := sorted(wanted - set(self.entries)):
            problems.append(f"training samples without a proximal entry {missing[:8]}")
        if extra := sorted(set(self.entries) - wanted):
            problems.append(f"proximal entries with no training sample {extra[:8]}")
        if problems:
            raise ProximalCacheError("cache <-> training samples is not a bijection: " + "; ".join(problems))

    def clear(self) -> None:
        """Drop every entry (used after every step and on every error path); keeps the counters."""
        self.entries.clear()
        self.nbytes = 0

    def reset_counters(self) -> None:
        """Start a new step's ``peak_bytes`` / ``transferred_bytes`` (call on an empty cache)."""
        self.peak_bytes = self.nbytes
        self.transferred_bytes = 0
