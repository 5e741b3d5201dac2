"""The trainer forward: which logprob each forward uses, and the fused path equal to the gather path."""
from __future__ import annotations

import numpy as np
import torch

from rollout.model.config import default_config
from rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from rollout.sample import Sample
from trainer.backends.torch_backend import response_logprobs
from trainer.batch import collate


def _setup(seed=0):
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(default_config(30))
    model.init_weights(seed)
    rng = np.random.default_rng(seed)
    samples = []
    for i, (P, R) in enumerate([(5, 3), (7, 1), (4, 4)]):
        response = rng.integers(0, 30, R).astype(np.int32)
        support = np.full((R, 1 + 6), -1, np.int32)
        for j, y in enumerate(response):
            others = rng.permutation([v for v in range(30) if v != y])[:4]
            support[j, 0], support[j, 1:6] = y, np.r_[others, y][rng.permutation(5)]
        samples.append(Sample(sample_id=i, group_id=i, rollout_id=0, policy_version=0,
                              prompt_ids=rng.integers(0, 30, P).astype(np.int32), response_ids=response,
                              loss_mask=np.ones(R, np.uint8), rollout_logprobs=np.zeros(R, np.float32),
                              sample_support=support))
    return model, samples


def test_policy_forward_normalises_over_the_support_not_the_vocabulary():
    model, samples = _setup()
    batch = collate(samples, routing=False, indexer=False, support=True)
    logp, _ = response_logprobs(model, batch, 0.7)
    # independent check: full forward per sample, float64 log-softmax over the support by hand
    expected = []
    for s in samples:
        tokens = torch.from_numpy(s.tokens.astype(np.int64))[None]
        with torch.no_grad():
            z = model(tokens, torch.arange(tokens.shape[1])[None]).logits[0].double() / 0.7
        for j, row in enumerate(s.sample_support):
            cand = [v for v in row[1:] if v >= 0]
            zz = z[len(s.prompt_ids) - 1 + j]
            expected.append(float(zz[row[0]] - torch.logsumexp(zz[cand], 0)))
    assert np.allclose(logp.detach().numpy(), expected, atol=1e-5)
    full = collate(samples, routing=False, indexer=False, support=False)
    logp_full, _ = response_logprobs(model, full, 0.7)
    assert (logp_full < logp - 1e-3).all()  # the full vocabulary holds strictly more mass


def test_fused_chunked_path_equals_the_logits_path_in_values_and_gradients():
    model, samples = _setup(1)
    batch = collate(samples, routing=False, indexer=False, support=True)
    results = []
    for chunk in (0, 3):
        model.zero_grad()
        logp, out = response_logprobs(model, batch, 1.3, chunk_size=chunk)
        (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
        results.append((logp.detach(), model.lm_head.weight.grad.clone(),
                        model.model.embed_tokens.weight.grad.clone(), out.logits))
    (v0, g0, e0, l0), (v1, g1, e1, l1) = results
    assert l0 is not None and l1 is None  # the fused forward never built [B, S, V] logits
    assert torch.allclose(v0, v1, atol=1e-6)
    assert torch.allclose(g0, g1, atol=1e-6) and torch.allclose(e0, e1, atol=1e-6)
