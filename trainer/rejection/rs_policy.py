"""The RS gate of a run, applied identically by the preflight and the training forward.

One frozen :class:`RSGate` turns per-sample proximal / behaviour logprobs into per-sample and
per-token accept decisions using the formulas in :mod:`replayrl.trainer.rejection.rs_gates`
(docs/design/trainer-math.md#trainer-math). Modes:

- ``none``: everything is accepted (plain decoupled PPO + TIS);
- ``token``: token ``t`` is accepted iff ``exp(d_t)`` is in ``[lower, upper]``; a *sample*
  passes (for group-atomic admission) only if every loss token passes;
- ``sequence`` / ``geometric``: the sample's ``exp(sum m d)`` / ``exp(mean m d)`` in bounds
  decides the sample, and all its tokens with it.

``m`` here is the mask of tokens the engine sampled (:attr:`replayrl.rollout.sample.Sample.sampled_mask`),
not the loss mask: a synthetic EOS is trained on but has no behaviour logprob, so it never
enters a gate (docs/design/rejection-sampling.md#rejection-sampling).

Loss denominator under RS (documented choice, tested in tests/system/test_refill.py): with refill off,
rejected tokens contribute 0 and the denominator is ``--rs-denominator``: ``loss_tokens`` (all
loss tokens of the step, so rejection shrinks the update like a smaller learning rate, as in
slime's masked RS) or ``accepted_tokens`` (only accepted ones). With exact refill on, every
trained sample is admitted whole, so both denominators are the same number.

What else the decisions mean without refill (docs/design/rejection-sampling.md#rejection-sampling,
applied by the TrainerActor): each group's GRPO baseline is over its samples the gate accepted (a
token-mode sample counts when at least one of its loss tokens is kept), a group with fewer than two
trains on nothing, and a step with no accepted token is skipped (or ends the run with
``--stop-on-empty-step``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from replayrl.trainer.rejection.rs_gates import SAMPLE_LOG_WEIGHTS, compute_log_ratio, sample_gate, token_gate
from replayrl.trainer.rejection.rs_settings import check_rs_settings


@dataclass(frozen=True)
class RSGate:
    """``mode`` in :data:`replayrl.trainer.rejection.rs_settings.MODES` with ratio bounds ``0 < lower <= upper``."""

    mode: str = "none"
    lower: float = 0.0
    upper: float = float("inf")

    def __post_init__(self) -> None:
        check_rs_settings(self.mode, self.lower, self.upper)

    @property
    def active(self) -> bool:
        """False for mode ``none``."""
        return self.mode != "none"

    def decide(self, logp_prox: Sequence[torch.Tensor], logp_rollout: Sequence[torch.Tensor],
               sampled_mask: Sequence[torch.Tensor]) -> tuple[list[bool], list[torch.Tensor]]:
        """Gate a list of samples (float32 [R_i] each).

        ``sampled_mask`` is each sample's :attr:`replayrl.rollout.sample.Sample.sampled_mask` (uint8 or
        bool [R_i], ``replayrl.trainer.batching.batch.sampled_masks``): only tokens the engine sampled have a
        behaviour logprob, so only they enter a gate. A synthetic EOS (loss-bearing, not
        sampled) changes neither a sequence sum nor the token count of a geometric mean; token
        RS accepts it (it has no ratio to reject), and a sample gate's decision covers it with
        the rest of its sample.

        Returns:
            ``(sample_accept, token_accept)``: one bool per sample, and one bool tensor [R_i]
            per sample (True = the token may contribute to the loss).
        Raises:
            replayrl.trainer.rejection.rs_gates.RSError: non-finite ratio at a sampled token (naming it).
        """
        if not self.active:
            return [True] * len(logp_prox), [torch.ones(len(m), dtype=torch.bool) for m in sampled_mask]
        ratios = [compute_log_ratio(p, r, m) for p, r, m in zip(logp_prox, logp_rollout, sampled_mask)]
        if self.mode == "token":
            tokens = [token_gate(d, m, self.lower, self.upper) for d, m in zip(ratios, sampled_mask)]
            return [bool(t.all()) for t in tokens], tokens
        accept = sample_gate(ratios, list(sampled_mask), self.lower, self.upper,
                             log_weight=SAMPLE_LOG_WEIGHTS[self.mode]).tolist()
        return accept, [torch.full((len(m),), ok, dtype=torch.bool) for ok, m in zip(accept, sampled_mask)]
