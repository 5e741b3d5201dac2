"""Policy-gradient loss: decoupled PPO clip with truncated importance sampling (TIS).

Per response token ``t`` with loss mask ``m_t`` (docs/design/trainer-math.md#trainer-math)::

    r_t = exp(logp_t - logp_prox_t)                       # policy vs proximal policy
    w_t = min(exp(logp_prox_t - logp_rollout_t), C)       # TIS weight, detached
    l_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

Tokens the engine never sampled (a synthetic EOS, docs/design/traces.md#trace-arrays; ``s_t = 0``
in ``sampled_mask`` while ``m_t = 1``) have no behaviour logprob, so they have no behaviour
ratio: ``w_t = 1`` and ``l_t`` is the clipped term on the proximal ratio ``r_t`` alone, with
the sample's advantage. The proximal policy is the trust-region anchor of the decoupled
objective (Hilton et al. 2022) and is defined for every token; the behaviour ratio is an
importance correction for the sampling distribution and exists only for sampled tokens. The
placeholder in ``logp_rollout`` at such a row is never read (not even checked for finiteness).
SkyRL (``skyrl_gym_generator.py``, the appended EOS of its agent loop) keeps such a token in the
loss with a dummy rollout logprob 0.0 and notes "logprobs will be extremely off" -- the defect
avoided here; its stop-string path masks the appended EOS out of the loss instead, which would
drop the "teach the policy to stop" signal the synthetic EOS exists for.

Sources: decoupled PPO objective with a proximal policy separate from the behaviour policy,
Hilton, Cobbe & Schulman 2022, "Batch size-invariance for policy optimization"; truncated
importance sampling for train-inference mismatch, Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training" (as in verl and slime); asymmetric clip
(``eps_high`` 0.28) from DAPO, Yu et al. 2025; the ``approx_kl`` metric is Schulman's k3
estimator ("Approximating KL divergence", 2020).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from replayrl.trainer.errors import LossError

__all__ = ["clipped_terms", "policy_loss", "tis_weights"]

Denominator = Literal["loss_tokens", "accepted_tokens"]


def _as_bool_mask(x: Tensor, n: int, name: str) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != 1 or x.shape[0] != n:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise LossError(f"{name} must be a 1-D tensor with {n} entries, got {shape}")
    if x.dtype == torch.bool:
        return x
    bad = (x != 0) & (x != 1)
    if bool(bad.any()):
        raise LossError(f"{name} must hold only 0/1, bad positions {torch.nonzero(bad).flatten().tolist()[:8]}")
    return x != 0


def policy_loss(
    logp: Tensor,
    logp_prox: Tensor,
    logp_rollout: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    tis_cap: float | None = 2.0,
    token_accept: Tensor | None = None,
    sampled_mask: Tensor | None = None,
    denominator: Denominator,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled-PPO clipped surrogate with TIS, averaged over tokens.

    Only ``logp`` carries gradient; ``logp_prox``, ``logp_rollout`` and ``advantages`` are
    detached. Positions with ``loss_mask`` 0 may hold NaN / inf in any input: every input is
    passed through ``torch.where`` before ``exp`` (multiplying by the mask would turn
    ``0 * inf`` into NaN), so the loss and the gradient stay finite.

    Denominator policy when RS rejects tokens (``token_accept`` False at a loss token; a
    rejected token always contributes 0 to the numerator):

    * ``"loss_tokens"``: divide by the number of loss tokens, rejected ones included, so a
      token's weight in the step does not depend on how many other tokens were rejected
      (rejection acts as a zero weight, the usual masked-IS estimator);
    * ``"accepted_tokens"``: divide by the number of accepted loss tokens (a self-normalised
      mean over the surviving tokens).

    With ``token_accept`` None both are the same. A batch whose denominator is 0 gives a loss
    of exactly 0 with zero gradient (``max(count, 1)``).

    Args:
        logp: float tensor [N], logprobs of the response tokens under the policy being trained
            (nats, with gradient).
        logp_prox: float tensor [N], proximal logprobs (preflight forward at the weights the
            step starts from).
        logp_rollout: float tensor [N], behaviour logprobs recorded by the rollout engine.
        advantages: float tensor [N], per-token advantage (e.g. GRPO, broadcast per sample).
        loss_mask: tensor [N] of 0/1 (bool / integer / float): 1 = loss-bearing token.
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]``; ``0 <= eps_low < 1``,
            ``eps_high >= 0`` (DAPO uses ``eps_high = 0.28``).
        tis_cap: TIS cap ``C > 0``; ``None`` disables TIS (``w = 1``).
        token_accept: optional bool tensor [N] from token RS (``replayrl.trainer.rejection.rs_gates.token_gate``).
        sampled_mask: optional tensor [N] of 0/1: 1 = the engine sampled this loss token, so
            ``logp_rollout`` holds its behaviour logprob (``replayrl.trainer.batching.batch.TrainBatch.sampled_mask``).
            A loss token with 0 here (a synthetic EOS) gets ``w = 1`` and is left out of
            ``logprob_abs_diff_mean`` and ``tis_weight_mean``; its ``logp_rollout`` is not read.
            Must be 0 wherever ``loss_mask`` is 0. ``None``: every loss token was sampled.
        denominator: ``"loss_tokens"`` or ``"accepted_tokens"`` (keyword, required: the policy
            is always stated by the caller).
        entropy_coef: ``beta >= 0``, the entropy bonus (docs/design/trainer-math.md#entropy-collapse): each
            contributing token's advantage becomes ``A_t - beta * logp_prox_t``, the
            score-function estimate of the gradient of ``beta`` times the policy's entropy
            (Williams & Peng 1991), so a token the policy rarely samples is pushed up even in a
            group whose rewards are all equal. Per token, so microbatches and data-parallel
            shares do not change it. 0 = off (the loss is exactly the one above). With
            ``--entropy-baseline`` the trainer centres this reward by subtracting ``beta * S``
            from ``advantages`` (:mod:`replayrl.trainer.loss.entropy_baseline`); this function
            adds no baseline.

    Returns:
        ``(loss, metrics)``: ``loss`` a 0-dim tensor (float32, or float64 for float64 ``logp``);
        ``metrics`` floats: ``clip_fraction`` (share of contributing tokens whose clipped term
        is the active one, i.e. gradient zeroed by the clip), split by side as
        ``clip_fraction_low`` (``A_t < 0`` and ``r_t < 1 - eps_low``) and ``clip_fraction_high``
        (``A_t > 0`` and ``r_t > 1 + eps_high``), and ``approx_kl`` (k3 of policy
        vs proximal) over contributing tokens (loss and accepted); ``tis_weight_mean`` over
        contributing sampled tokens; ``logprob_abs_diff_mean`` (mean
        ``|logp_prox - logp_rollout|``) over sampled loss tokens; ``loss_tokens``,
        ``sampled_tokens``, ``accepted_tokens``, ``accepted_fraction``.

    Raises:
        LossError: shape mismatch, mask values other than 0/1, bad hyper-parameters, an unknown
            denominator, a ``sampled_mask`` set where ``loss_mask`` is 0, or a non-finite
            input at a loss token (``logp_rollout``: at a sampled loss token), naming the
            positions.
    """
    n = _check_inputs(logp, logp_prox, logp_rollout, advantages, eps_low=eps_low,
                      eps_high=eps_high, tis_cap=tis_cap, denominator=denominator,
                      entropy_coef=entropy_coef)
    mask, contrib, sampled = _token_masks(n, loss_mask, token_accept, sampled_mask)
    _check_finite((("logp", logp, mask), ("logp_prox", logp_prox, mask),
                   ("logp_rollout", logp_rollout, sampled), ("advantages", advantages, mask)))

    dtype = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    # Sanitise every input outside the loss mask *before* any exp or product.
    lp = torch.where(mask, logp.to(dtype), zero)
    prox = torch.where(mask, logp_prox.detach().to(dtype), zero)
    # a token the engine never sampled has no behaviour logprob: its placeholder is not read
    roll = torch.where(sampled, logp_rollout.detach().to(dtype), zero)
    adv = torch.where(mask, advantages.detach().to(dtype), zero)
    if entropy_coef:  # per token, so the update does not depend on how the batch is split
        adv = adv - entropy_coef * torch.where(contrib, prox, zero)

    log_r = lp - prox
    ratio = torch.exp(log_r)
    w = tis_weights(prox, roll, sampled, tis_cap)
    unclipped, clipped = clipped_terms(ratio, adv, eps_low, eps_high)
    per_token = -w * torch.minimum(unclipped, clipped)
    per_token = torch.where(contrib, per_token, zero)
    loss = _token_mean(per_token, mask, contrib, denominator)

    with torch.no_grad():
        metrics = _loss_metrics(mask, contrib, sampled, prox=prox, roll=roll, log_r=log_r,
                                ratio=ratio, w=w, unclipped=unclipped, clipped=clipped)
    return loss, metrics


def _check_inputs(logp: Tensor, logp_prox: Tensor, logp_rollout: Tensor, advantages: Tensor, *,
                  eps_low: float, eps_high: float, tis_cap: float | None,
                  denominator: str, entropy_coef: float = 0.0) -> int:
    """The token count ``N`` of :func:`policy_loss`'s inputs, after checking their shapes and
    the hyper-parameters (raises :class:`LossError` as documented there)."""
    if not isinstance(logp, Tensor) or logp.dim() != 1 or not logp.is_floating_point():
        raise LossError(f"logp must be a 1-D float tensor, got {type(logp).__name__}")
    n = logp.shape[0]
    for name, x in (("logp_prox", logp_prox), ("logp_rollout", logp_rollout), ("advantages", advantages)):
        if not isinstance(x, Tensor) or x.dim() != 1 or x.shape[0] != n or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise LossError(f"{name} must be a 1-D float tensor with {n} entries, got {shape}")
    if denominator not in ("loss_tokens", "accepted_tokens"):
        raise LossError(f"denominator must be 'loss_tokens' or 'accepted_tokens', got {denominator!r}")
    if not (0.0 <= eps_low < 1.0) or not (eps_high >= 0.0) or math.isinf(eps_high):
        raise LossError(f"clip range needs 0 <= eps_low < 1 and finite eps_high >= 0, got "
                        f"eps_low={eps_low!r}, eps_high={eps_high!r}")
    if not (0.0 <= entropy_coef < math.inf):
        raise LossError(f"entropy_coef must be finite and >= 0, got {entropy_coef!r}")
    if tis_cap is not None and not (tis_cap > 0.0):
        raise LossError(f"tis_cap must be > 0 or None, got {tis_cap!r}")
    return n


def _token_masks(n: int, loss_mask: Tensor, token_accept: Tensor | None,
                 sampled_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Bool ``[N]`` masks ``(loss, contributing, sampled)``: loss tokens; loss tokens RS
    accepted (all loss tokens when ``token_accept`` is None); loss tokens the engine sampled
    (all loss tokens when ``sampled_mask`` is None). Raises :class:`LossError` for a mask of
    the wrong shape, with values other than 0/1, or ``sampled_mask`` set outside the loss."""
    mask = _as_bool_mask(loss_mask, n, "loss_mask")
    if token_accept is None:
        contrib = mask
    else:
        if not isinstance(token_accept, Tensor) or token_accept.dtype != torch.bool:
            raise LossError("token_accept must be a bool tensor (from replayrl.trainer.rejection.rs_gates.token_gate)")
        contrib = mask & _as_bool_mask(token_accept, n, "token_accept")

    if sampled_mask is None:
        sampled = mask
    else:
        sampled = _as_bool_mask(sampled_mask, n, "sampled_mask")
        outside = sampled & ~mask
        if bool(outside.any()):
            raise LossError(f"sampled_mask set where loss_mask is 0 at positions "
                            f"{torch.nonzero(outside).flatten().tolist()[:8]}")
    return mask, contrib, sampled


def _check_finite(inputs: tuple[tuple[str, Tensor, Tensor], ...]) -> None:
    """Raise :class:`LossError` naming the first ``(name, tensor, where)`` of ``inputs`` that
    holds a non-finite value where the bool mask ``where`` is set, and its positions."""
    for name, x, where in inputs:
        bad = where & ~torch.isfinite(x.detach())
        if bool(bad.any()):
            raise LossError(f"non-finite {name} at loss tokens {torch.nonzero(bad).flatten().tolist()[:8]}")


def tis_weights(logp_prox: Tensor, logp_rollout: Tensor, sampled: Tensor,
                tis_cap: float | None) -> Tensor:
    """Truncated importance weights ``w_t = min(exp(logp_prox_t - logp_rollout_t), C)``.

    Args:
        logp_prox: float tensor [N], proximal logprobs (nats), finite everywhere (sanitised).
        logp_rollout: float tensor [N] of the same dtype, behaviour logprobs (nats), finite
            everywhere (sanitised: 0 where ``sampled`` is False).
        sampled: bool tensor [N]: the engine sampled the token, so it has a behaviour ratio.
        tis_cap: the cap ``C > 0``; ``None`` disables TIS.

    Returns:
        Float tensor [N] in ``logp_prox``'s dtype: ``w_t``, or 1 at a token the engine never
        sampled (no behaviour ratio) and everywhere when ``tis_cap`` is None. Carries no
        gradient when its inputs are detached. Raises nothing (inputs are checked by
        :func:`policy_loss`).
    """
    if tis_cap is None:
        return torch.ones_like(logp_prox)
    w = torch.clamp(torch.exp(logp_prox - logp_rollout), max=float(tis_cap))
    return torch.where(sampled, w, torch.ones_like(w))  # no behaviour ratio: weight 1


def clipped_terms(ratio: Tensor, advantages: Tensor, eps_low: float,
                  eps_high: float) -> tuple[Tensor, Tensor]:
    """The two PPO surrogate terms ``(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)``.

    Args:
        ratio: float tensor [N], ``r_t = exp(logp_t - logp_prox_t)`` (may carry gradient).
        advantages: float tensor [N] of the same dtype, ``A_t``.
        eps_low, eps_high: the clip range (checked by :func:`policy_loss`).

    Returns:
        ``(unclipped, clipped)``, float tensors [N] in ``ratio``'s dtype; the surrogate is
        their element-wise minimum, and the clip is active where ``clipped < unclipped``.
        Raises nothing.
    """
    return ratio * advantages, torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages


def _token_mean(per_token: Tensor, mask: Tensor, contrib: Tensor, denominator: str) -> Tensor:
    """Sum of ``per_token`` (0 outside ``contrib``) over the denominator's token count
    (``max(count, 1)``): loss tokens or accepted loss tokens, see :func:`policy_loss`."""
    n_loss = int(mask.sum())
    n_acc = int(contrib.sum())
    count = n_loss if denominator == "loss_tokens" else n_acc
    return per_token.sum() / max(count, 1)


def _loss_metrics(mask: Tensor, contrib: Tensor, sampled: Tensor, *, prox: Tensor, roll: Tensor,
                  log_r: Tensor, ratio: Tensor, w: Tensor, unclipped: Tensor,
                  clipped: Tensor) -> dict[str, float]:
    """:func:`policy_loss`'s metrics (see its Returns) from its masks and per-token terms."""
    dtype = prox.dtype
    zero = torch.zeros((), dtype=dtype, device=prox.device)
    n_loss = int(mask.sum())
    n_acc = int(contrib.sum())
    c = contrib.to(dtype)
    denom_c = max(n_acc, 1)
    c_sampled = (contrib & sampled).to(dtype)
    n_acc_sampled = int((contrib & sampled).sum())
    n_sampled = int(sampled.sum())
    abs_diff = torch.where(sampled, (prox - roll).abs(), zero)
    active = clipped < unclipped
    return {
        "clip_fraction": float((active.to(dtype) * c).sum() / denom_c),
        "clip_fraction_low": float(((active & (ratio < 1.0)).to(dtype) * c).sum() / denom_c),
        "clip_fraction_high": float(((active & (ratio > 1.0)).to(dtype) * c).sum() / denom_c),
        "tis_weight_mean": (float((w * c_sampled).sum() / n_acc_sampled)
                            if n_acc_sampled else 0.0),
        "approx_kl": float((((ratio - 1.0) - log_r) * c).sum() / denom_c),
        "logprob_abs_diff_mean": float(abs_diff.sum() / max(n_sampled, 1)),
        "loss_tokens": float(n_loss),
        "sampled_tokens": float(n_sampled),
        "accepted_tokens": float(n_acc),
        "accepted_fraction": n_acc / n_loss if n_loss else 0.0,
    }
