"""Decoupled PPO + TIS loss against hand computations."""

from __future__ import annotations

import json
import math

import pytest
import torch

from replayrl.trainer.errors import LossError
from replayrl.trainer.loss.losses import policy_loss
from tests.paths import CASES

NAN = float("nan")

# Six tokens: 0 unclipped (A > 0), 1 clipped high (A > 0) with TIS capped, 2 clipped low
# (A < 0), 3 unclipped above the clip (A < 0, pessimistic branch), 4 masked out with NaN
# rollout logprob and NaN advantage, 5 a loss token rejected by token RS.
LOGP = [-1.0, -0.3, -2.5, -0.1, 0.7, -0.4]
PROX = [-1.1, -0.6, -2.0, -0.3, -1.0, -0.5]
ROLL = [-1.2, -1.6, -1.6, -0.3, NAN, -0.2]
ADV = [1.0, 1.0, -2.0, -1.0, NAN, 0.5]
MASK = [1, 1, 1, 1, 0, 1]
ACCEPT = [True, True, True, True, True, False]
EPS_LOW, EPS_HIGH, CAP = 0.2, 0.2, 2.0


def hand_token(i):
    """Per-token loss and d loss / d logp written out from the formula with math.*."""
    r = math.exp(LOGP[i] - PROX[i])
    w = min(math.exp(PROX[i] - ROLL[i]), CAP)
    a = ADV[i]
    unclipped, clipped = r * a, min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH) * a
    if unclipped <= clipped:
        return -w * unclipped, -w * a * r, False, w
    return -w * clipped, 0.0, True, w


def tensors(dtype=torch.float64):
    logp = torch.tensor(LOGP, dtype=dtype, requires_grad=True)
    prox = torch.tensor(PROX, dtype=dtype, requires_grad=True)
    return logp, prox, torch.tensor(ROLL, dtype=dtype), torch.tensor(ADV, dtype=dtype), torch.tensor(MASK)


def test_hand_computed_branches_are_the_intended_ones():
    # Guards the fixture itself: tokens 1 and 2 clip, 0 and 3 do not, token 1's TIS is capped.
    assert [hand_token(i)[2] for i in range(4)] == [False, True, True, False]
    assert hand_token(1)[3] == CAP


@pytest.mark.parametrize("denominator, count", [("loss_tokens", 5), ("accepted_tokens", 4)])
def test_loss_and_grad_match_hand_computation(denominator, count):
    logp, prox, roll, adv, mask = tensors()
    loss, metrics = policy_loss(
        logp, prox, roll, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, tis_cap=CAP,
        token_accept=torch.tensor(ACCEPT), denominator=denominator,
    )
    contributing = [0, 1, 2, 3]  # token 4 masked, token 5 rejected
    want = sum(hand_token(i)[0] for i in contributing) / count
    assert loss.item() == pytest.approx(want, rel=1e-12)
    loss.backward()
    want_grad = [hand_token(i)[1] / count if i in contributing else 0.0 for i in range(6)]
    assert logp.grad.tolist() == pytest.approx(want_grad, rel=1e-12, abs=1e-15)
    assert prox.grad is None  # proximal logprobs are detached
    assert metrics["clip_fraction"] == pytest.approx(2 / 4)
    assert metrics["tis_weight_mean"] == pytest.approx(sum(hand_token(i)[3] for i in contributing) / 4)
    loss_tokens = [0, 1, 2, 3, 5]
    assert metrics["logprob_abs_diff_mean"] == pytest.approx(
        sum(abs(PROX[i] - ROLL[i]) for i in loss_tokens) / 5)
    k3 = [math.exp(LOGP[i] - PROX[i]) - 1 - (LOGP[i] - PROX[i]) for i in contributing]
    assert metrics["approx_kl"] == pytest.approx(sum(k3) / 4)
    assert (metrics["loss_tokens"], metrics["accepted_tokens"]) == (5.0, 4.0)
    assert metrics["accepted_fraction"] == pytest.approx(0.8)


def test_without_rs_both_denominators_agree_and_tis_can_be_disabled():
    logp, prox, roll, adv, mask = tensors()
    a, _ = policy_loss(logp, prox, roll, adv, mask, tis_cap=None, denominator="loss_tokens")
    b, m = policy_loss(logp, prox, roll, adv, mask, tis_cap=None, denominator="accepted_tokens")
    assert a.item() == b.item()
    assert m["tis_weight_mean"] == 1.0
    r = [math.exp(LOGP[i] - PROX[i]) for i in range(6)]
    want = sum(-min(r[i] * ADV[i], min(max(r[i], 0.8), 1.2) * ADV[i]) for i in [0, 1, 2, 3, 5]) / 5
    assert a.item() == pytest.approx(want, rel=1e-12)


def test_asymmetric_clip_high():
    # r = exp(0.24) = 1.271 with A > 0: clipped at 1.2 under eps_high 0.2, not under 0.28.
    args = (torch.tensor([0.24], requires_grad=True), torch.zeros(1), torch.zeros(1), torch.ones(1), torch.ones(1))
    lo, m_lo = policy_loss(*args, eps_high=0.2, denominator="loss_tokens")
    hi, m_hi = policy_loss(*args, eps_high=0.28, denominator="loss_tokens")
    assert lo.item() == pytest.approx(-1.2) and m_lo["clip_fraction"] == 1.0
    assert hi.item() == pytest.approx(-math.exp(0.24), rel=1e-6) and m_hi["clip_fraction"] == 0.0


def test_nan_in_masked_slot_case_keeps_loss_and_grad_finite():
    case = next(c for c in json.loads((CASES / "trace_alignment.json").read_text())
                if c["name"] == "nan_in_masked_slot")
    roll = torch.tensor(case["rollout_logprobs"], dtype=torch.float32)
    mask = torch.tensor(case["loss_mask"])
    logp = torch.tensor([-0.4, float("-inf")], requires_grad=True)
    prox = torch.tensor([-0.45, float("inf")])
    loss, metrics = policy_loss(logp, prox, roll, torch.tensor([1.0, float("inf")]), mask,
                                denominator="loss_tokens")
    loss.backward()
    assert math.isfinite(loss.item()) and bool(torch.isfinite(logp.grad).all())
    assert logp.grad[1].item() == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    # Value check on the one loss token: r = e^0.05, w = e^0.05 (< cap), unclipped.
    assert loss.item() == pytest.approx(-math.exp(0.05) * math.exp(0.05), rel=1e-6)


def test_no_contributing_token_gives_zero_loss():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, m = policy_loss(logp, logp.detach(), logp.detach(), torch.ones(2), torch.ones(2),
                          token_accept=torch.tensor([False, False]), denominator="accepted_tokens")
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.tolist() == [0.0, 0.0] and m["accepted_fraction"] == 0.0


def test_errors():
    ok = (torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(2))
    with pytest.raises(LossError, match="denominator"):
        policy_loss(*ok, denominator="tokens")
    with pytest.raises(TypeError):
        policy_loss(*ok)  # the denominator policy must be stated
    with pytest.raises(LossError, match="tis_cap"):
        policy_loss(*ok, tis_cap=0.0, denominator="loss_tokens")
    with pytest.raises(LossError, match="eps_low"):
        policy_loss(*ok, eps_low=1.0, denominator="loss_tokens")
    with pytest.raises(LossError, match="0/1"):
        policy_loss(*ok[:4], torch.tensor([1, 3]), denominator="loss_tokens")
    with pytest.raises(LossError, match=r"logp_rollout at loss tokens \[1\]"):
        policy_loss(ok[0], ok[1], torch.tensor([0.0, NAN]), ok[3], ok[4], denominator="loss_tokens")
    with pytest.raises(LossError, match="advantages"):
        policy_loss(*ok[:3], torch.zeros(3), ok[4], denominator="loss_tokens")
    with pytest.raises(LossError, match="token_accept"):
        policy_loss(*ok, token_accept=torch.ones(2), denominator="loss_tokens")
