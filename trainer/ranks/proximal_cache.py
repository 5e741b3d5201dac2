"""Proximal logprobs of one step, held in pinned CPU memory between preflight and update.

The preflight forward runs at the weights the optimizer step starts from; its per-token
logprobs are the proximal policy of decoupled PPO (Hilton et al. 2022) and the numerator of
the RS / TIS ratios. They wait on the trainer rank in page-locked memory (so the copy back to
an accelerator is asynchronous) under a byte cap. A CPU-only torch build cannot pin; the cache
then uses pageable memory and reports ``pinned=False`` instead of failing.
"""
from __future__ import annotations

import torch

from replayrl.trainer.errors import ProximalCacheError


def can_pin_memory() -> bool:
    """Whether this torch build and machine can allocate page-locked host memory."""
    try:
        return torch.empty(1).pin_memory().is_pinned()
    except RuntimeError:  # CPU-only builds raise: no accelerator to pin for
        return False


class ProximalLogprobCache:
    """``sample_id -> float32 [R]`` proximal logprobs, pinned when possible.

    Args:
        max_bytes: cap on the tensor payload (``--rs-refill-max-candidate-cache-bytes``).
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.pinned = can_pin_memory()
        self.entries: dict[int, torch.Tensor] = {}
        self.nbytes = 0
        self.peak_bytes = 0
        self.transferred_bytes = 0

    def put(self, sample_id: int, logprobs: torch.Tensor) -> None:
        """Store a copy of ``logprobs`` (float32 [R]) for ``sample_id``.

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
        host.copy_(logprobs.detach())
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
            return self.entries[sample_id]
        except KeyError:
            raise ProximalCacheError(f"sample {sample_id} is not in the proximal cache") from None

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
