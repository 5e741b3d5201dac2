"""Decode attention over a block-shared prompt (rollout/model/shared_prefix.py, KVCache.share_rows).

References: attention written out in float64 (softmax over the allowed keys of the prompt
repeated per row, then the row's own keys), and the engine's own decode with the prompt copied
to every row (KVCache.select_rows), which this replaces.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import replayrl.rollout.model.qwen3_moe as qwen3_moe
from replayrl.rollout.model.kv_cache import KVCache
from replayrl.rollout.model.shared_prefix import SharedPrefix, block_size, shared_prefix_attention
from replayrl.rollout.sample import TRACE_FIELDS
from replayrl.rollout.sampling.sampling_params import SamplingParams
from tests.unit.rollout.test_engine import make_engine, reference  # noqa: F401 (fixture)


@pytest.mark.parametrize("rows, expected", [
    ([0, 0, 1, 1], 2), ([4, 4, 4], 3), ([1, 1, 0, 0, 1, 1], 2),  # a prompt repeated in two groups
    ([0, 0, 1, 1, 1, 1], 2),  # blocks of 2, two of them the same prompt
    ([0, 1], 0), ([0, 0, 1], 0), ([0, 0, 0, 1, 1], 0), ([0, 1, 0, 1], 0), ([3], 0)])
def test_block_size(rows, expected):
    assert block_size(torch.tensor(rows)) == expected


@pytest.mark.parametrize("h, h_kv", [(4, 2), (2, 2), (4, 1)])
def test_attention_equals_the_softmax_over_the_repeated_prompt_and_own_keys(h, h_kv):
    g_, r, d, p, t = 3, 4, 8, 6, 5
    gen = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen)
    q, pk, pv, ok, ov = rand(g_ * r, h, 1, d), rand(g_, h_kv, p, d), rand(g_, h_kv, p, d), \
        rand(g_ * r, h_kv, t, d), rand(g_ * r, h_kv, t, d)
    prompt_real = torch.ones(g_, p, dtype=torch.bool)
    prompt_real[1, :2] = False  # left padding of block 1
    own = torch.rand(g_ * r, 1, t, generator=gen) > 0.4
    own[:, 0, -1] = True  # every row sees its own newest key
    bias = torch.zeros(g_, p).masked_fill(~prompt_real, float("-inf"))[:, None, None, :]
    out = shared_prefix_attention(q, SharedPrefix(pk, pv, bias, r), ok, ov, own, 0.3)

    want = np.zeros((g_ * r, h, d))
    for b in range(g_ * r):
        keys = np.concatenate([pk[b // r].double().numpy(), ok[b].double().numpy()], axis=1)
        values = np.concatenate([pv[b // r].double().numpy(), ov[b].double().numpy()], axis=1)
        allowed = np.concatenate([prompt_real[b // r].numpy(), own[b, 0].numpy()])
        for head in range(h):
            kv = head // (h // h_kv)
            s = 0.3 * keys[kv] @ q[b, head, 0].double().numpy()
            s = np.where(allowed, s, -np.inf)
            w = np.exp(s - s.max())
            want[b, head] = (w / w.sum()) @ values[kv]
    assert out.shape == (g_ * r, h, 1, d) and out.dtype == torch.float32
    np.testing.assert_allclose(out[:, :, 0].double().numpy(), want, atol=2e-6)


def _decode_both(engine, prompts, params):
    kwargs = dict(max_new_tokens=6, eos_token_id=31, seed=4, traces=frozenset(TRACE_FIELDS))
    calls = []
    real = qwen3_moe.shared_prefix_attention
    qwen3_moe.shared_prefix_attention = lambda *a: calls.append(1) or real(*a)
    try:
        shared = engine.generate(prompts, params, **kwargs)
    finally:
        qwen3_moe.shared_prefix_attention = real
    share_rows = KVCache.share_rows
    KVCache.share_rows = KVCache.select_rows  # every row a copy of its prompt, as before
    try:
        copied = engine.generate(prompts, params, **kwargs)
    finally:
        KVCache.share_rows = share_rows
    return shared, copied, len(calls)


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(temperature=1.0, top_k=12)],
                         ids=["greedy", "top-k"])
def test_engine_decode_over_shared_prompts_equals_copied_prompts(reference, params):  # noqa: F811
    _, arrays = reference
    engine = make_engine(arrays)
    a, b = [3, 7, 1, 9, 4], [5, 2]  # b is left padded
    shared, copied, calls = _decode_both(engine, [a] * 3 + [b] * 3, params)
    assert calls > 0  # the dense layer took the shared path
    for x, y in zip(shared, copied):
        assert x.response_ids.tolist() == y.response_ids.tolist()
        np.testing.assert_allclose(x.rollout_logprobs, y.rollout_logprobs, atol=1e-5)
        for field in TRACE_FIELDS:
            assert np.array_equal(getattr(x, field), getattr(y, field)), field


def test_prompts_not_side_by_side_are_copied(reference):  # noqa: F811
    _, arrays = reference
    a, b = [3, 7, 1, 9, 4], [5, 2]
    _, _, calls = _decode_both(make_engine(arrays), [a, b, a, b], SamplingParams(top_k=1))
    assert calls == 0


def test_select_rows_of_a_shared_cache_puts_the_prompt_back(reference):  # noqa: F811
    model, _ = reference
    ids = torch.tensor([[0, 5, 2], [3, 7, 1]])
    real = torch.tensor([[False, True, True], [True, True, True]])
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    rows = torch.tensor([0, 0, 1, 1])
    with torch.no_grad():
        cache = model.new_kv_cache()
        model(ids, pos, key_padding_mask=real, kv_cache=cache)
        shared, copied = cache.share_rows(rows), cache.select_rows(rows)
        back = shared.select_rows(torch.arange(4))
    dense = [i for i in range(len(model.model.layers)) if i not in model.config.indexed_layers]
    assert dense and all(shared.past(i)[3] is not None for i in dense)
    for i in range(len(model.model.layers)):
        for part in range(3):
            want, got = copied.past(i)[part], back.past(i)[part]
            assert (want is None and got is None) or torch.equal(want, got)
