"""Token sampler with top-k / top-p / min-p and support capture.

The sampler turns one row of next-token logits into a sampled id, the behaviour (rollout)
logprob of that id under the *processed* distribution, and the support row the trainer needs
to replay that distribution exactly (docs/design/trainer-math.md#trainer-math: support replay
``log p~(y) = z_y - logsumexp_{v in S} z_v`` with ``z = logits / temperature``).

Processing order (the order SGLang and vLLM users expect):

1. ``z = logits / temperature`` (in float32, whatever the input dtype).
2. top-k: keep the ``W = support_width(V)`` highest ``z``; ties are broken by the lower id, so
   the candidate order (descending ``z``, then ascending id) is a pure function of the logits.
3. top-p (nucleus, Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"): with
   ``p`` the softmax of the top-k candidates, a candidate is removed when the probability mass
   strictly before it in the candidate order already reaches ``top_p``; the first candidate is
   therefore always kept. Skipped when ``top_p == 1`` (no candidate of non-zero mass could be
   removed in exact arithmetic, so float rounding must not remove one either).
4. min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"): a candidate is removed
   when its probability is below ``min_p * max(p)``. The ratio to the max is invariant under
   renormalisation, so it does not matter whether ``p`` is taken before or after top-p.
5. sample from the renormalised survivors with the caller's ``torch.Generator``
   (``torch.multinomial`` on the fixed-shape ``[N, W]`` rows, reproducible for a seeded
   generator).

The sampled logprob is ``z_y - logsumexp`` over the survivors, i.e. exactly what the trainer's
support replay recomputes from the ``sample_support`` row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayrl.rollout.errors import NonFiniteLogitsError, SamplerError
from replayrl.rollout.sampling.sampling_params import SamplingParams

__all__ = [
    "SampleOutput",
    "sample",
]


@dataclass(frozen=True, eq=False)  # eq on tensors would be ambiguous; compare fields explicitly
class SampleOutput:
    """Result of :func:`sample` for ``N`` rows.

    Fields:
        ids: int64 ``[N]``, sampled token ids.
        logprobs: float32 ``[N]``, log-probability of ``ids`` under the processed (renormalised)
            distribution: ``z_y - logsumexp`` over the non-``-1`` candidate columns of ``support``.
        support: int32 ``[N, 1 + W]``; column 0 the sampled id, columns ``1..W`` the top-W
            candidate ids in descending ``z`` (ties: lower id first), ``-1`` where top-p / min-p
            removed the candidate.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    support: torch.Tensor


def _top_candidates(z: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``width`` values and ids of each row of ``z`` [N, V] (float32).

    Order: descending value, ties by ascending id; which of several tied values at the top-k
    boundary are kept is decided by the lower id too. ``torch.topk`` alone guarantees neither,
    so its result is re-sorted stably and rows with a tie across the boundary fall back to a
    full stable sort (rare for real logits).
    """
    n, v = z.shape
    if width == v:
        values, ids = torch.sort(z, dim=-1, descending=True, stable=True)
        return values, ids
    values, ids = torch.topk(z, width, dim=-1, largest=True, sorted=True)
    # Stable sort by value descending after sorting by id ascending: ties end up id-ascending.
    by_id = torch.argsort(ids, dim=-1, stable=True)
    ids = ids.gather(1, by_id)
    values = values.gather(1, by_id)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    values = values.gather(1, order)
    ids = ids.gather(1, order)
    boundary = values[:, -1:]
    tied_rows = ((z >= boundary).sum(dim=-1) > width).nonzero().flatten()
    if tied_rows.numel() > 0:
        full_values, full_ids = torch.sort(z[tied_rows], dim=-1, descending=True, stable=True)
        values[tied_rows] = full_values[:, :width]
        ids[tied_rows] = full_ids[:, :width]
    return values, ids


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> SampleOutput:
    """Sample one token per row under temperature / top-k / top-p / min-p.

    Args:
        logits: ``[N, V]`` tensor of any floating dtype; processing is done in float32.
        params: the sampling parameters.
        generator: a ``torch.Generator`` on ``logits.device``; the only source of randomness,
            so a seeded generator reproduces the result.

    Returns:
        :class:`SampleOutput` (see its fields; processing order in the module docstring).

    Raises:
        SamplerError: if ``logits`` is not a 2-D floating tensor with ``N >= 1`` and ``V >= 1``.
        SamplingParamsError: if ``top_k > V``.
        NonFiniteLogitsError: if a top-k candidate of some row has a NaN / infinite ``z``
            (NaN and +inf always rank among the candidates, so any NaN or +inf in a row is
            reported); the message names the first such row. ``-inf`` outside the candidate
            set (e.g. masked vocabulary padding) is allowed.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise SamplerError(
            "logits must be a 2-D floating tensor [N, V], got "
            f"{type(logits).__name__} {getattr(logits, 'shape', None)} "
            f"{getattr(logits, 'dtype', None)}"
        )
    n, v = logits.shape
    if n < 1 or v < 1:
        raise SamplerError(f"logits must have N >= 1 rows and V >= 1 columns, got {tuple(logits.shape)}")
    width = params.support_width(v)

    z = logits.to(torch.float32) / params.temperature
    values, cand_ids = _top_candidates(z, width)

    bad = ~torch.isfinite(values).all(dim=-1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise NonFiniteLogitsError(
            f"logits row {row}: non-finite value among the top-{width} candidates "
            f"(temperature {params.temperature}); {int(bad.sum())} row(s) affected"
        )

    keep = torch.ones_like(values, dtype=torch.bool)
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = torch.softmax(values, dim=-1)
        if params.top_p < 1.0:
            # Mass strictly before each candidate; the first is 0, so at least one survives.
            mass_before = torch.cumsum(probs, dim=-1) - probs
            keep &= mass_before < params.top_p
        if params.min_p > 0.0:
            # probs[:, :1] is the row max (candidates are sorted); it always survives.
            keep &= probs >= params.min_p * probs[:, :1]

    kept_z = values.masked_fill(~keep, float("-inf"))
    log_norm = torch.logsumexp(kept_z, dim=-1, keepdim=True)
    kept_probs = torch.exp(kept_z - log_norm)
    choice = torch.multinomial(kept_probs, 1, replacement=True, generator=generator)

    ids = cand_ids.gather(1, choice).squeeze(1).to(torch.int64)
    logprobs = (values.gather(1, choice) - log_norm).squeeze(1).to(torch.float32)
    support = torch.empty((n, 1 + width), dtype=torch.int32, device=logits.device)
    support[:, 0] = ids.to(torch.int32)
    support[:, 1:] = cand_ids.masked_fill(~keep, -1).to(torch.int32)
    return SampleOutput(ids=ids, logprobs=logprobs, support=support)
