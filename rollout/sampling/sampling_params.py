"""Sampling parameters of one request (:class:`SamplingParams`), without torch.

The rollout manager and the run configuration check and pass these on; only the engine's
sampler (:mod:`replayrl.rollout.sampling.sampler`, which re-exports the class) needs torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from replayrl.rollout.errors import SamplingParamsError

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request.

    Fields:
        temperature: float > 0 (finite); logits are divided by it. Greedy decoding is
            ``top_k=1``.
        top_k: ``-1`` (off: the whole vocabulary is the candidate set) or an int >= 1.
        top_p: nucleus mass in ``(0, 1]``; ``1`` = off.
        min_p: relative probability floor in ``[0, 1)``; ``0`` = off.

    Raises:
        SamplingParamsError: on any value outside the ranges above (message names the field).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SamplingParamsError(f"SamplingParams.{name} must be a number, got {value!r}")
        if not (self.temperature > 0.0 and self.temperature < float("inf")):
            raise SamplingParamsError(
                f"SamplingParams.temperature must be finite and > 0, got {self.temperature!r}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p < 1.0):
            raise SamplingParamsError(f"SamplingParams.min_p must be in [0, 1), got {self.min_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise SamplingParamsError(f"SamplingParams.top_k must be an int, got {self.top_k!r}")
        if not (self.top_k == -1 or self.top_k >= 1):
            raise SamplingParamsError(
                f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k!r}"
            )

    def support_width(self, vocab_size: int) -> int:
        """Number of candidate columns ``W`` of a support row (``sample_support`` has ``1 + W``).

        Returns ``top_k`` if top-k is on, else ``vocab_size``.

        Raises:
            SamplingParamsError: if ``vocab_size < 1`` or ``top_k > vocab_size`` (never clamped).
        """
        if vocab_size < 1:
            raise SamplingParamsError(f"vocab_size must be >= 1, got {vocab_size!r}")
        if self.top_k > vocab_size:
            raise SamplingParamsError(
                f"SamplingParams.top_k={self.top_k} exceeds vocab_size={vocab_size}"
            )
        return self.top_k if self.top_k > 0 else vocab_size
