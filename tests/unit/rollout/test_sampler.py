"""Sampler tests against a plain numpy float64 reference written here (one row at a time)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from replayrl.rollout.errors import NonFiniteLogitsError, SamplerError, SamplingParamsError
from replayrl.rollout.sampling.sampler import sample
from replayrl.rollout.sampling.sampling_params import SamplingParams
from tests.paths import CASES

CASES = CASES


def reference_row(logits_row, temperature, top_k, top_p, min_p):
    """Naive float64 reference: (candidate ids with -1 for removed, kept mask, z) of one row."""
    z = np.asarray(logits_row, dtype=np.float64) / temperature
    vocab = len(z)
    width = top_k if top_k > 0 else vocab
    order = sorted(range(vocab), key=lambda i: (-z[i], i))[:width]
    cand_z = np.array([z[i] for i in order])
    p = np.exp(cand_z - cand_z.max())
    p = p / p.sum()
    kept = []
    mass = 0.0
    for j in range(width):
        keep = True
        if top_p < 1.0 and mass >= top_p:
            keep = False
        if p[j] < min_p * p.max():
            keep = False
        kept.append(keep)
        mass += p[j]
    support = [order[j] if kept[j] else -1 for j in range(width)]
    return support, z


def reference_logprob(z, support, y):
    """Support replay log p~(y) = z_y - logsumexp_{v in S} z_v in float64."""
    s = np.array([z[v] for v in support if v != -1])
    m = s.max()
    return z[y] - (m + math.log(np.exp(s - m).sum()))


PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.6),
    SamplingParams(top_k=5),
    SamplingParams(top_k=1),
    SamplingParams(top_p=0.8),
    SamplingParams(top_p=0.3),
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.5),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=20, min_p=0.05),
    SamplingParams(temperature=0.6, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.7, min_p=0.1),
]


@pytest.mark.parametrize("params", PARAMS, ids=repr)
def test_support_and_logprobs_match_reference(params):
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 2.0, size=(32, 40)).astype(np.float32)
    out = sample(torch.from_numpy(logits), params, torch.Generator().manual_seed(1))
    width = params.top_k if params.top_k > 0 else 40
    assert out.ids.dtype == torch.int64 and out.ids.shape == (32,)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (32,)
    assert out.support.dtype == torch.int32 and out.support.shape == (32, 1 + width)
    for r in range(32):
        support, z = reference_row(logits[r], params.temperature, params.top_k, params.top_p, params.min_p)
        assert out.support[r, 1:].tolist() == support
        y = int(out.ids[r])
        assert int(out.support[r, 0]) == y
        assert y in support
        assert float(out.logprobs[r]) == pytest.approx(reference_logprob(z, support, y), abs=1e-6)


def test_hand_computed_top_p():
    # softmax([2, 1, 0, -1]) = [0.6439, 0.2369, 0.0871, 0.0321]; mass before id 1 is 0.6439 < 0.7,
    # before id 2 it is 0.8808 >= 0.7, so the support is {0, 1}.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(200, 1)
    out = sample(logits, SamplingParams(top_p=0.7), torch.Generator().manual_seed(0))
    assert out.support[:, 1:].tolist() == [[0, 1, -1, -1]] * 200
    lse = math.log(math.exp(2.0) + math.exp(1.0))
    for y, lp in zip(out.ids.tolist(), out.logprobs.tolist()):
        assert lp == pytest.approx({0: 2.0 - lse, 1: 1.0 - lse}[y], abs=1e-6)


def test_top_p_boundary_mass_exactly_reached_removes_the_rest():
    # Four equal logits: p = 0.25 each (exact in binary). With top_p = 0.5 the mass before the
    # third candidate is exactly 0.5 >= top_p, so only the first two survive.
    out = sample(torch.zeros(1, 4), SamplingParams(top_p=0.5), torch.Generator().manual_seed(0))
    assert out.support[0, 1:].tolist() == [0, 1, -1, -1]
    assert float(out.logprobs[0]) == pytest.approx(math.log(0.5), abs=1e-7)


def test_hand_computed_min_p():
    # probs ∝ [e^2, e^1, e^0, e^-1]; min_p=0.3 keeps p >= 0.3 p_max, i.e. z >= 2 + ln 0.3 = 0.796.
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    out = sample(logits, SamplingParams(min_p=0.3), torch.Generator().manual_seed(0))
    assert out.support[0, 1:].tolist() == [1, 3, -1, -1]


def test_ties_are_broken_by_lower_id_including_top_k_boundary():
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0],  # three-way tie at the top
            [3.0, 1.0, 3.0, 3.0, 2.0],  # tie across the top-2 boundary: 0 and 2 win over 3
            [0.0, 0.0, 0.0, 0.0, 0.0],  # all tied
        ]
    )
    out = sample(logits, SamplingParams(top_k=2), torch.Generator().manual_seed(0))
    assert out.support[:, 1:].tolist() == [[1, 2], [0, 2], [0, 1]]
    full = sample(logits, SamplingParams(), torch.Generator().manual_seed(0))
    assert full.support[:, 1:].tolist() == [[1, 2, 4, 0, 3], [0, 2, 3, 4, 1], [0, 1, 2, 3, 4]]


def test_acceptance_case_support_rows_arise_and_logprobs_match():
    # Rows of tests/cases/support_logprobs.json reproduced by the sampler with matching params;
    # whenever the case's sampled id is drawn, the rollout logprob equals the expected value.
    cases = {c["name"]: c for c in json.loads((CASES / "support_logprobs.json").read_text())}
    rows = [
        (cases["support_logprob_top_k_2"], 0, SamplingParams(top_k=2)),
        (cases["support_logprob_temperature_and_padding"], 0, SamplingParams(temperature=0.7, top_k=3, top_p=0.9)),
        (cases["support_logprob_temperature_and_padding"], 1, SamplingParams(temperature=0.7, top_k=3)),
    ]
    for case, r, params in rows:
        assert params.temperature == case["temperature"]
        logits = torch.tensor([case["logits"][r]], dtype=torch.float32).repeat(4000, 1)
        out = sample(logits, params, torch.Generator().manual_seed(3))
        assert out.support[:, 1:].tolist() == [case["support"][r]] * 4000
        hits = out.ids == case["sampled"][r]
        assert int(hits.sum()) > 0
        expected = case["expected_support_logprob"][r]
        assert torch.allclose(out.logprobs[hits], torch.full((int(hits.sum()),), expected), atol=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.5, top_k=6),
        SamplingParams(top_p=0.85),
        SamplingParams(temperature=1.5, top_k=8, top_p=0.9, min_p=0.05),
    ],
    ids=repr,
)
def test_empirical_frequencies_match_processed_distribution(params):
    row = np.array([1.2, -0.3, 0.8, 2.0, 0.1, -1.5, 0.9, 0.0, -0.7, 1.7], dtype=np.float32)
    draws = 40000
    logits = torch.from_numpy(row).repeat(draws, 1)
    out = sample(logits, params, torch.Generator().manual_seed(1234))
    support, z = reference_row(row, params.temperature, params.top_k, params.top_p, params.min_p)
    kept = [v for v in support if v != -1]
    counts = np.bincount(out.ids.numpy(), minlength=len(row))
    assert counts[[v for v in range(len(row)) if v not in kept]].sum() == 0
    expected = np.array([math.exp(reference_logprob(z, support, v)) * draws for v in kept])
    observed = counts[kept]
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = max(len(kept) - 1, 1)
    # Seeded draws; the bound is the mean plus ~8 standard deviations of a chi-square(dof).
    assert chi2 < dof + 8 * math.sqrt(2 * dof)


def test_reproducible_with_seeded_generator():
    logits = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.9, top_k=16, top_p=0.95)
    a = sample(logits, params, torch.Generator().manual_seed(7))
    b = sample(logits, params, torch.Generator().manual_seed(7))
    c = sample(logits, params, torch.Generator().manual_seed(8))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.support, b.support)
    assert not torch.equal(a.ids, c.ids)


def test_bfloat16_logits_are_processed_in_float32():
    rng = np.random.default_rng(5)
    logits_bf16 = torch.from_numpy(rng.normal(size=(8, 30)).astype(np.float32)).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_k=10, min_p=0.05)
    out = sample(logits_bf16, params, torch.Generator().manual_seed(0))
    as_f32 = logits_bf16.float().numpy()
    for r in range(8):
        support, z = reference_row(as_f32[r], 0.7, 10, 1.0, 0.05)
        assert out.support[r, 1:].tolist() == support
        y = int(out.ids[r])
        assert float(out.logprobs[r]) == pytest.approx(reference_logprob(z, support, y), abs=1e-6)


def test_minus_inf_outside_candidates_is_allowed():
    logits = torch.tensor([[1.0, float("-inf"), 0.5, float("-inf")]])
    out = sample(logits, SamplingParams(top_k=2), torch.Generator().manual_seed(0))
    assert out.support[0, 1:].tolist() == [0, 2]
    assert torch.isfinite(out.logprobs).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logit_in_kept_set_names_the_row(bad):
    logits = torch.zeros(4, 6)
    logits[2, 3] = bad
    with pytest.raises(NonFiniteLogitsError, match="row 2"):
        sample(logits, SamplingParams(), torch.Generator().manual_seed(0))


def test_nan_is_reported_even_with_top_k():
    logits = torch.zeros(3, 6)
    logits[1, 5] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="row 1"):
        sample(logits, SamplingParams(top_k=2), torch.Generator().manual_seed(0))


def test_temperature_overflow_is_reported():
    logits = torch.tensor([[1e38, 0.0], [0.0, 1.0]])
    with pytest.raises(NonFiniteLogitsError, match="row 0"):
        sample(logits, SamplingParams(temperature=0.01), torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"temperature": "1"}, "temperature"),
    ],
)
def test_sampling_params_errors(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_support_width():
    assert SamplingParams().support_width(100) == 100
    assert SamplingParams(top_k=7).support_width(100) == 7
    with pytest.raises(SamplingParamsError, match="top_k"):
        SamplingParams(top_k=101).support_width(100)
    with pytest.raises(SamplingParamsError, match="top_k"):
        sample(torch.zeros(1, 4), SamplingParams(top_k=5), torch.Generator())


def test_bad_logits_shape_or_dtype():
    with pytest.raises(SamplerError):
        sample(torch.zeros(5), SamplingParams(), torch.Generator())
    with pytest.raises(SamplerError):
        sample(torch.zeros(2, 5, dtype=torch.int64), SamplingParams(), torch.Generator())
    with pytest.raises(SamplerError):
        sample(torch.zeros(0, 5), SamplingParams(), torch.Generator())
