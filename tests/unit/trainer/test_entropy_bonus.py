"""The entropy bonus of policy_loss (--entropy-coef) and the clip fraction split by side,
against hand computations (docs/design/trainer-math.md#entropy-collapse)."""
from __future__ import annotations

import math

import pytest
import torch

from replayrl.trainer.errors import LossError
from replayrl.trainer.loss.losses import policy_loss


def test_bonus_gradient_is_the_centred_score_function_entropy_term():
    # all advantages 0 (a group whose rewards are all equal): only the bonus moves the policy
    values = [-0.1, -2.0, -0.5]
    logp = torch.tensor(values, requires_grad=True)
    beta = 0.1
    loss, _ = policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(3), torch.ones(3),
                          denominator="loss_tokens", entropy_coef=beta)
    loss.backward()
    # ratio 1 and weight 1: loss = -(1/3) sum_t A'_t r_t with A'_t = -beta logp_t, so
    # d loss / d logp_t = beta logp_t / 3: every sampled token is pushed up, the rare one (-2.0)
    # twenty times harder than the likely one (-0.1)
    expected = [beta * v / 3 for v in values]
    assert logp.grad.tolist() == pytest.approx(expected, abs=1e-7)
    assert logp.grad[1] / logp.grad[0] == pytest.approx(20.0)


def test_bonus_skips_tokens_outside_the_loss_and_zero_is_the_plain_loss():
    logp = torch.tensor([-0.2, -1.0, float("nan")], requires_grad=True)
    mask = torch.tensor([1, 1, 0])
    adv = torch.tensor([0.5, -0.5, 0.0])
    loss, _ = policy_loss(logp, logp.detach(), logp.detach(), adv, mask,
                          denominator="loss_tokens", entropy_coef=1.0)
    loss.backward()
    # A' = 0.5 + 0.2 = 0.7 and -0.5 + 1.0 = 0.5; d loss / d logp_t = -A'_t / 2 (two loss tokens)
    assert logp.grad.tolist()[:2] == pytest.approx([-0.7 / 2, -0.5 / 2])
    assert logp.grad[2] == 0
    plain = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, denominator="loss_tokens")
    zero = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, denominator="loss_tokens",
                       entropy_coef=0.0)
    assert torch.equal(plain[0], zero[0])


@pytest.mark.parametrize("beta", [-0.1, math.inf, math.nan])
def test_bad_coefficient_is_refused(beta):
    t = torch.zeros(2)
    with pytest.raises(LossError, match="entropy_coef"):
        policy_loss(t, t, t, t, torch.ones(2), denominator="loss_tokens", entropy_coef=beta)


def test_clip_fraction_by_side():
    # ratios exp(logp - prox): 1.5 (A > 0: above 1 + 0.28, clipped high), 0.5 (A < 0: below
    # 1 - 0.2, clipped low), 1.5 with A < 0 (unclipped term is the smaller: not clipped),
    # 1.0 (inside)
    prox = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 1.0]))
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    _, m = policy_loss(logp, prox, prox, adv, torch.ones(4), eps_low=0.2, eps_high=0.28,
                       denominator="loss_tokens")
    assert (m["clip_fraction_high"], m["clip_fraction_low"], m["clip_fraction"]) == (0.25, 0.25, 0.5)


def test_bonus_does_not_depend_on_how_the_tokens_are_split():
    # two microbatches, each averaged over the step's 4 tokens (the trainer rescales each
    # microbatch loss to the step's denominator), give the one-batch gradient
    logp = torch.tensor([-0.3, -1.7, -0.2, -2.5], requires_grad=True)
    adv = torch.tensor([0.2, 0.2, -0.1, -0.1])
    whole, _ = policy_loss(logp, logp.detach(), logp.detach(), adv, torch.ones(4),
                           denominator="loss_tokens", entropy_coef=0.05)
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts = sum(policy_loss(logp[i:i + 2], logp[i:i + 2].detach(), logp[i:i + 2].detach(),
                            adv[i:i + 2], torch.ones(2), denominator="loss_tokens",
                            entropy_coef=0.05)[0] * 2 / 4 for i in (0, 2))
    (g_parts,) = torch.autograd.grad(parts, logp)
    assert torch.allclose(g_whole, g_parts, atol=1e-7)
