"""Support replay, full-vocabulary and fused LM-head logprobs against float64 references."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replayrl.trainer.errors import LogprobError, SupportError
from replayrl.trainer.loss.logprobs import (
    full_vocab_logprobs,
    fused_support_logprobs,
    support_entropy,
    support_logprobs,
)
from tests.paths import CASES

CASES = CASES


# ----------------------------------------------------------------- naive float64 references


def ref_logprob_row(z: torch.Tensor, row: list[int]) -> torch.Tensor:
    """One row, written from the definition with a Python loop over the candidates."""
    y, cands = row[0], [c for c in row[1:] if c >= 0]
    if y < 0:
        return z.new_zeros(())
    pool = cands if cands else list(range(z.shape[0]))  # synthetic EOS: whole vocabulary
    return z[y] - torch.log(sum(torch.exp(z[v]) for v in pool))


def ref_entropy_row(z: torch.Tensor, row: list[int]) -> torch.Tensor:
    y, cands = row[0], [c for c in row[1:] if c >= 0]
    if y < 0:
        return z.new_zeros(())
    pool = cands if cands else list(range(z.shape[0]))
    norm = sum(torch.exp(z[v]) for v in pool)
    return -sum(torch.exp(z[v]) / norm * (z[v] - torch.log(norm)) for v in pool)


def reference(logits64: torch.Tensor, support: torch.Tensor, temperature: float, fn=ref_logprob_row):
    z = logits64 / temperature
    return torch.stack([fn(z[i], support[i].tolist()) for i in range(z.shape[0])])


def random_batch(seed: int, n: int = 10, vocab: int = 13, hid: int = 6, k: int = 4):
    """Hidden states, LM head and a support tensor mixing every row kind."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hid, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hid, generator=g, dtype=torch.float64)
    rows = []
    for i in range(n):
        perm = torch.randperm(vocab, generator=g)[:k].tolist()
        n_valid = 1 + i % k
        cands = perm[:n_valid] + [-1] * (k - n_valid)
        y = perm[i % n_valid]
        rows.append([y] + cands)
    rows[2] = [5] + [-1] * k  # synthetic-EOS fallback row
    rows[7] = [-1] * (k + 1)  # padding / observation row
    rows[9] = [11] + [-1] * k  # a second fallback row
    return hidden, weight, torch.tensor(rows, dtype=torch.int32)


# ----------------------------------------------------------------- acceptance cases


@pytest.mark.parametrize("case", json.loads((CASES / "support_logprobs.json").read_text()), ids=lambda c: c["name"])
def test_support_logprob_cases(case):
    logits = torch.tensor(case["logits"], dtype=torch.float32)
    support = torch.tensor([[y] + s for y, s in zip(case["sampled"], case["support"])])
    got = support_logprobs(logits, support, case["temperature"])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(case["expected_support_logprob"], dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)
    full = full_vocab_logprobs(logits, torch.tensor(case["sampled"]), case["temperature"])
    torch.testing.assert_close(full.double(), torch.tensor(case["expected_full_vocab_logprob"], dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)
    # A row with every candidate excluded is the synthetic-EOS fallback: full-vocabulary value.
    fallback = torch.full_like(support, -1)
    fallback[:, 0] = support[:, 0]
    got_fb = support_logprobs(logits, fallback, case["temperature"])
    torch.testing.assert_close(got_fb.double(), torch.tensor(case["expected_full_vocab_logprob"], dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)
    # The fused path from hidden = logits, W = I reproduces the same numbers.
    eye = torch.eye(logits.shape[1])
    fused = fused_support_logprobs(logits, eye, support, case["temperature"], chunk_size=1)
    torch.testing.assert_close(fused.double(), torch.tensor(case["expected_support_logprob"], dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)


def test_hand_computed_top_k_2():
    # logits [2, 1, 0, -1], support {0, 1}, y = 0: -log(1 + e^-1).
    got = support_logprobs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), torch.tensor([[0, 0, 1]]), 1.0)
    assert got.item() == pytest.approx(-math.log1p(math.exp(-1.0)), abs=1e-6)


# ----------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_support_logprobs_values_and_grads_match_reference(dtype):
    hidden, weight, support = random_batch(0)
    logits64 = (hidden @ weight.T).requires_grad_(True)
    ref = reference(logits64, support, 0.8)
    upstream = torch.linspace(0.5, 1.5, ref.shape[0], dtype=torch.float64)
    (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), logits64)

    logits = logits64.detach().to(dtype).requires_grad_(True)
    got = support_logprobs(logits, support, 0.8)
    assert got.dtype == torch.float32
    (grad,) = torch.autograd.grad((got * upstream.float()).sum(), logits)
    assert grad.dtype == dtype
    # Compare against the reference evaluated on the same (possibly rounded) logits.
    ref_same = reference(logits.detach().double(), support, 0.8)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype != torch.bfloat16 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.double(), ref_same, **tol)
    torch.testing.assert_close(grad.double(), ref_grad, **tol)
    assert got[7].item() == 0.0 and bool((grad[7] == 0).all())  # padding row


def test_full_vocab_logprobs_reference_and_no_target():
    hidden, weight, _ = random_batch(1)
    logits64 = hidden @ weight.T
    targets = torch.tensor([0, 3, 12, -1, 5, 5, 1, 2, 9, 4])
    got = full_vocab_logprobs(logits64, targets, 1.3)
    assert got.dtype == torch.float32
    z = logits64 / 1.3
    for i, y in enumerate(targets.tolist()):
        want = 0.0 if y < 0 else (z[i, y] - torch.log(torch.exp(z[i]).sum())).item()
        assert got[i].item() == pytest.approx(want, abs=1e-5)


def test_support_entropy_matches_reference():
    hidden, weight, support = random_batch(2)
    logits64 = (hidden @ weight.T).requires_grad_(True)
    ref = reference(logits64, support, 0.9, fn=ref_entropy_row)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits64)
    logits = logits64.detach().float().requires_grad_(True)
    got = support_entropy(logits, support, 0.9)
    (grad,) = torch.autograd.grad(got.sum(), logits)
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-5)
    # A single-candidate support is a point mass: entropy 0.
    one = support_entropy(logits.detach(), torch.tensor([[3, 3, -1, -1, -1]] * 10), 0.9)
    assert bool((one.abs() < 1e-6).all())


# ----------------------------------------------------------------- fused LM head


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 10, 64])
def test_fused_equals_gather_values_and_grads(chunk_size):
    hidden64, weight64, support = random_batch(3)
    upstream = torch.linspace(-1.0, 2.0, hidden64.shape[0])

    h_a = hidden64.float().requires_grad_(True)
    w_a = weight64.float().requires_grad_(True)
    gather = support_logprobs(h_a @ w_a.T, support, 0.7)
    ga_h, ga_w = torch.autograd.grad((gather * upstream).sum(), (h_a, w_a))

    h_b = hidden64.float().requires_grad_(True)
    w_b = weight64.float().requires_grad_(True)
    fused = fused_support_logprobs(h_b, w_b, support, 0.7, chunk_size)
    gb_h, gb_w = torch.autograd.grad((fused * upstream).sum(), (h_b, w_b))

    torch.testing.assert_close(fused, gather, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb_h, ga_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb_w, ga_w, rtol=1e-5, atol=1e-5)

    # And both against the float64 reference.
    h64 = hidden64.clone().requires_grad_(True)
    w64 = weight64.clone().requires_grad_(True)
    ref = reference(h64 @ w64.T, support, 0.7)
    r_h, r_w = torch.autograd.grad((ref * upstream.double()).sum(), (h64, w64))
    torch.testing.assert_close(fused.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb_h.double(), r_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb_w.double(), r_w, rtol=1e-5, atol=1e-5)


def test_fused_fixed_fallback_slots_and_vocab_blocks():
    hidden64, weight64, support = random_batch(4)
    # One slot per "trajectory" (rows 2, 5, 9): row 5 is an ordinary support row whose slot
    # is computed and discarded; vocab blocks of 4 do not divide V = 13.
    slots = torch.tensor([2, 5, 9])
    h = hidden64.float().requires_grad_(True)
    w = weight64.float().requires_grad_(True)
    fused = fused_support_logprobs(h, w, support, 1.1, 4, fallback_rows=slots, vocab_chunk_size=4)
    g_h, g_w = torch.autograd.grad(fused.sum(), (h, w))
    h64 = hidden64.clone().requires_grad_(True)
    w64 = weight64.clone().requires_grad_(True)
    ref = reference(h64 @ w64.T, support, 1.1)
    r_h, r_w = torch.autograd.grad(ref.sum(), (h64, w64))
    torch.testing.assert_close(fused.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_h.double(), r_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_w.double(), r_w, rtol=1e-5, atol=1e-5)
    gathered = support_logprobs(hidden64 @ weight64.T, support, 1.1, fallback_rows=slots)
    torch.testing.assert_close(gathered.double(), ref.detach(), rtol=1e-5, atol=1e-5)


def test_fallback_row_uses_full_vocabulary():
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.7, 0.1]], dtype=torch.float64)
    got = support_logprobs(logits, torch.tensor([[3, -1, -1]]), 0.5)
    z = logits[0] / 0.5
    assert got.item() == pytest.approx((z[3] - torch.logsumexp(z, 0)).item(), abs=1e-6)
    # K = 0 (no candidate columns at all): every non-padding row is a fallback row.
    got0 = support_logprobs(logits, torch.tensor([[3]]), 0.5)
    assert got0.item() == pytest.approx(got.item(), abs=1e-7)


def test_padding_rows_are_zero_with_no_gradient_even_under_nan_upstream():
    hidden64, weight64, support = random_batch(5)
    h = hidden64.float().requires_grad_(True)
    w = weight64.float().requires_grad_(True)
    out = fused_support_logprobs(h, w, support, 1.0, 3)
    assert out[7].item() == 0.0
    upstream = torch.ones_like(out)
    upstream[7] = float("nan")
    g_h, g_w = torch.autograd.grad(out, (h, w), grad_outputs=upstream)
    assert bool(torch.isfinite(g_h).all()) and bool(torch.isfinite(g_w).all())
    assert bool((g_h[7] == 0).all())


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_fused_never_materialises_rows_by_vocab():
    n, vocab, hid, k, chunk = 256, 4000, 4, 3, 16
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(n, hid, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hid, generator=g, requires_grad=True)
    cands = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    support = torch.cat([cands[:, :1], cands], dim=1)
    support[10, 1:] = -1  # one fallback row
    with _LargestTensor() as probe:
        out = fused_support_logprobs(hidden, weight, support, 1.0, chunk, vocab_chunk_size=500)
        out.sum().backward()
    # The gradient of the weight itself (V x H = 16000) is the largest thing allowed.
    assert probe.largest <= vocab * hid < n * vocab
    assert bool(torch.isfinite(hidden.grad).all())


# ----------------------------------------------------------------- errors


def test_sampled_id_missing_from_candidates_names_the_row():
    logits = torch.zeros(3, 6)
    support = torch.tensor([[1, 1, 2], [4, 0, 3], [2, 2, -1]])
    with pytest.raises(SupportError, match=r"\[1\]"):
        support_logprobs(logits, support, 1.0)
    with pytest.raises(SupportError, match=r"\[1\]"):
        fused_support_logprobs(torch.zeros(3, 2), torch.zeros(6, 2), support, 1.0, 2)
    with pytest.raises(SupportError, match=r"\[1\]"):
        support_entropy(logits, support, 1.0)


@pytest.mark.parametrize(
    "support, pattern",
    [
        ([[1, 1, 1]], "duplicate"),
        ([[6, 6, -1]], "outside"),
        ([[1, -2, 1]], "outside"),
        ([[-1, 1, -1]], "no sampled id"),
        ([[1.0, 1.0, 2.0]], "integer"),
    ],
)
def test_bad_support_rows_raise(support, pattern):
    dtype = torch.float32 if isinstance(support[0][0], float) else torch.int64
    with pytest.raises(SupportError, match=pattern):
        support_logprobs(torch.zeros(1, 6), torch.tensor(support, dtype=dtype), 1.0)


def test_fallback_slots_must_cover_fallback_rows():
    logits = torch.zeros(3, 6)
    support = torch.tensor([[1, 1, 2], [4, -1, -1], [2, 2, -1]])
    with pytest.raises(SupportError, match=r"\[1\]"):
        support_logprobs(logits, support, 1.0, fallback_rows=torch.tensor([0, 2]))
    with pytest.raises(SupportError, match="repeated"):
        support_logprobs(logits, support, 1.0, fallback_rows=torch.tensor([1, 1]))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature_raises(temperature):
    with pytest.raises(LogprobError, match="temperature"):
        support_logprobs(torch.zeros(1, 4), torch.tensor([[1, 1, -1]]), temperature)


def test_bad_shapes_raise():
    with pytest.raises(SupportError, match="rows"):
        support_logprobs(torch.zeros(2, 4), torch.tensor([[1, 1]]), 1.0)
    with pytest.raises(LogprobError, match="hidden size"):
        fused_support_logprobs(torch.zeros(1, 3), torch.zeros(4, 2), torch.tensor([[1, 1]]), 1.0, 1)
    with pytest.raises(LogprobError, match="chunk_size"):
        fused_support_logprobs(torch.zeros(1, 2), torch.zeros(4, 2), torch.tensor([[1, 1]]), 1.0, 0)
    with pytest.raises(LogprobError, match="targets"):
        full_vocab_logprobs(torch.zeros(1, 4), torch.tensor([4]), 1.0)
