"""The trainer forward: which logprob each forward uses, and the fused path equal to the gather path."""
from __future__ import annotations

import numpy as np
import torch

from replayrl.rollout.model.config import default_config
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sample import Sample
from replayrl.trainer.backends.torch_backend import _shared_prefix, response_logprobs
from replayrl.trainer.batching.batch import collate


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
    # float32 gradients summed in another order (chunks of 3 rows): measured 1.4e-6 apart on
    # the embedding gradient, whose largest entry is 2.5, i.e. 6e-7 of it; 1e-6 absolute was
    # tighter than float32 round-off on the small entries
    scale = max(float(g0.abs().max()), float(e0.abs().max()))
    assert torch.allclose(g0, g1, atol=2e-6 * scale) and torch.allclose(e0, e1, atol=2e-6 * scale)


def _group_samples(seed: int, rows_with_other_trace: tuple[int, ...] = ()):
    """Two prompt groups of three samples (shared prompts, different responses) with routing
    and indexer traces captured by an unreplayed forward of each sample alone."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(default_config(30))
    model.init_weights(seed)
    rng = np.random.default_rng(seed)
    samples = []
    for g, P in enumerate((6, 6)):
        prompt = rng.integers(0, 30, P).astype(np.int32)
        for k in range(3):
            i = 3 * g + k
            R = 2 if k else 1
            response = rng.integers(0, 30, R).astype(np.int32)
            tokens = torch.from_numpy(np.r_[prompt, response].astype(np.int64))[None]
            with torch.no_grad():
                out = model(tokens[:, :-1], torch.arange(P + R - 1)[None], capture=True)
            routed, keys = out.routed_experts[0].numpy(), out.indexer_topk[0].numpy()
            if i in rows_with_other_trace:
                routed = routed.copy()
                routed[0, 0] = routed[0, 0][::-1]  # same set, another order: a different trace
            support = np.full((R, 1 + 5), -1, np.int32)
            support[:, 0] = support[:, 1] = response
            support[:, 2:] = [[v for v in rng.permutation(30) if v != y][:4] for y in response]
            samples.append(Sample(sample_id=i, group_id=g, rollout_id=0, policy_version=0,
                                  prompt_ids=prompt, response_ids=response,
                                  loss_mask=np.ones(R, np.uint8),
                                  rollout_logprobs=np.zeros(R, np.float32), sample_support=support,
                                  routed_experts=routed, indexer_topk=keys))
    return model, samples


def _logprobs_and_grads(model, samples, weights):
    model.zero_grad()
    logp, out = response_logprobs(model, collate(samples, routing=True, indexer=True, support=True),
                                  0.9, capture=True)
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), out, grads


def test_shared_prompts_forwarded_once_equal_every_sample_forwarded_alone():
    # the batch path forwards each group's prompt once (rows share tokens and traces); the
    # reference forwards every sample alone (a batch of one shares nothing)
    for other in ((), (4,)):  # (4,): one sample's prompt trace differs -> the plain forward
        model, samples = _group_samples(5, other)
        batch = collate(samples, routing=True, indexer=True, support=True)
        inputs = {k: getattr(batch, k) for k in ("tokens", "position_ids", "key_padding_mask",
                                                  "routed_experts", "indexer_topk")}
        assert (_shared_prefix(inputs, int(batch.pos.min())) is None) == bool(other)
        weights = torch.linspace(-1, 1, sum(len(s.response_ids) for s in samples))
        logp, out, grads = _logprobs_and_grads(model, samples, weights)
        parts = weights.split([len(s.response_ids) for s in samples])
        alone = [_logprobs_and_grads(model, [s], w) for s, w in zip(samples, parts)]
        assert torch.allclose(logp, torch.cat([a[0] for a in alone]), atol=1e-5)
        for b, s in enumerate(samples):  # the choices used / own, row by row
            n = s.total_length - 1
            for key in ("routed_experts", "indexer_topk", "own_routed_experts", "own_indexer_topk"):
                assert torch.equal(getattr(out, key)[b, :n], getattr(alone[b][1], key)[0, :n]), key
        total = {k: sum(a[2][k] for a in alone if k in a[2]) for k in grads}
        # an expert reached only by the last layer at positions that predict nothing gets an
        # all-zero gradient alone and none at all when the prompt is shared
        nonzero = lambda g: {k for k, v in g.items() if bool(v.abs().sum() > 0)}
        assert nonzero(grads) == set().union(*(nonzero(a[2]) for a in alone))
        for k in grads:
            assert torch.allclose(grads[k], total[k], atol=1e-5, rtol=1e-4), k
