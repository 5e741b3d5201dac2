"""Incremental decoding with the KV cache reproduces a full forward of each unpadded sequence.

Engine layout: a batch of 2 prompts of different lengths, left padded, prefilled at once, then
decoded one token per step with per-row positions; compared with a cache-free forward of each row
on its own (no padding). Traces are compared after mapping key slots to positions.
"""

import pytest
import torch

from replayrl.rollout.model import KVCache, ModelInputError, Qwen3MoeForCausalLM, default_config
from tests.model_helpers import decisive_model

V = 32
ATOL = 2e-5


def _model(seed):
    return decisive_model(default_config(V), seed)


def _slots_to_positions(slots, pad):
    return torch.where(slots >= 0, slots - pad, slots)


def test_left_padded_incremental_decode_matches_full_forward():
    model = _model(seed=21)
    g = torch.Generator().manual_seed(0)
    prompt_lens, steps = [5, 9], 8
    seqs = [torch.randint(3, V, (n + steps,), generator=g) for n in prompt_lens]
    width = max(prompt_lens)
    pads = [width - n for n in prompt_lens]

    # Prefill: left padded prompts, positions count real tokens only.
    ids = torch.zeros(2, width, dtype=torch.long)
    real = torch.zeros(2, width, dtype=torch.bool)
    for b, (n, pad) in enumerate(zip(prompt_lens, pads)):
        ids[b, pad:] = seqs[b][:n]
        real[b, pad:] = True
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    cache = model.new_kv_cache()
    assert isinstance(cache, KVCache) and cache.length == 0
    logits, experts, slots = [], [], []
    with torch.no_grad():
        out = model(ids, pos, key_padding_mask=real, kv_cache=cache, capture=True)
        assert cache.length == width
        logits.append(out.logits)
        experts.append(out.routed_experts)
        slots.append(out.indexer_topk)
        # Decode: feed the known continuation one token per step (teacher forcing).
        for step in range(steps):
            tok = torch.stack([seqs[b][prompt_lens[b] + step] for b in range(2)])[:, None]
            p = torch.tensor([[prompt_lens[b] + step] for b in range(2)])
            real = torch.cat([real, torch.ones(2, 1, dtype=torch.bool)], dim=1)
            out = model(tok, p, key_padding_mask=real, kv_cache=cache, capture=True)
            assert cache.length == width + step + 1
            logits.append(out.logits)
            experts.append(out.routed_experts)
            slots.append(out.indexer_topk)
    logits, experts, slots = (torch.cat(x, dim=1) for x in (logits, experts, slots))

    for b in range(2):
        with torch.no_grad():
            full = model(seqs[b][None], torch.arange(len(seqs[b]))[None], capture=True)
        got = slice(pads[b], None)
        torch.testing.assert_close(logits[b, got], full.logits[0], atol=ATOL, rtol=0)
        assert torch.equal(experts[b, got], full.routed_experts[0])
        assert torch.equal(_slots_to_positions(slots[b, got], pads[b]), full.indexer_topk[0])
    # Late queries of the longer row really are sparse (more causal keys than index_topk).
    assert ((slots[1, -1] >= 0).sum(-1) == model.config.index_topk).all()


def test_chunked_prefill_equals_single_prefill():
    model = _model(seed=22)
    ids = torch.randint(0, V, (2, 14), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(14).expand(2, 14)
    with torch.no_grad():
        full = model(ids, pos, capture=True)
        cache = model.new_kv_cache()
        a = model(ids[:, :6], pos[:, :6], kv_cache=cache, capture=True)
        b = model(ids[:, 6:], pos[:, 6:], kv_cache=cache, capture=True)
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full.logits, atol=ATOL, rtol=0)
    assert torch.equal(torch.cat([a.indexer_topk, b.indexer_topk], 1), full.indexer_topk)
    assert torch.equal(torch.cat([a.routed_experts, b.routed_experts], 1), full.routed_experts)


def test_bf16_decode_runs_and_stays_finite():
    model = _model(seed=23).to(torch.bfloat16)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(2))
    real = torch.ones(2, 6, dtype=torch.bool)
    real[0, :2] = False
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    cache = model.new_kv_cache()
    with torch.no_grad():
        out = model(ids, pos, key_padding_mask=real, kv_cache=cache, capture=True)
        real = torch.cat([real, torch.ones(2, 1, dtype=torch.bool)], 1)
        step = model(ids[:, :1], pos[:, -1:] + 1, key_padding_mask=real, kv_cache=cache, capture=True)
    assert out.logits.dtype == torch.bfloat16 and step.logits.dtype == torch.bfloat16
    assert torch.isfinite(out.logits).all() and torch.isfinite(step.logits).all()
    assert step.indexer_topk.shape == (2, 1, 2, 8) and step.routed_experts.shape == (2, 1, 3, 2)


def test_cache_misuse_is_rejected_and_leaves_cache_unchanged():
    model = _model(seed=24)
    cache = model.new_kv_cache()
    ids = torch.zeros(2, 3, dtype=torch.long)
    pos = torch.arange(3).expand(2, 3)
    real = torch.ones(2, 3, dtype=torch.bool)
    real[0, 0] = False
    with torch.no_grad():
        model(ids, pos, key_padding_mask=real, kv_cache=cache)
        with pytest.raises(ModelInputError, match="key_padding_mask"):
            model(ids[:, :1], pos[:, :1], key_padding_mask=real, kv_cache=cache)  # length 3, needs 4
        with pytest.raises(ModelInputError, match="differs"):
            model(ids[:, :1], pos[:, :1], kv_cache=cache)  # None = all real, but slot 0 was padding
        with pytest.raises(ModelInputError, match="batch size"):
            model(ids[:1, :1], pos[:1, :1], kv_cache=cache)
        other = Qwen3MoeForCausalLM(default_config(V).__class__(**{
            **default_config(V).__dict__, "num_hidden_layers": 2, "index_layers": (1,)}))
        with pytest.raises(ModelInputError, match="other layers"):
            other(ids, pos, kv_cache=cache)
    assert cache.length == 3 and cache.batch_size == 2


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_append_along_equals_cat_and_reuses_its_buffer_without_autograd(mode):
    # inference_mode is the engine's decode loop: there a view's _base is None, and appends
    # found no buffer to reuse before (each one copied the whole cache)
    from replayrl.rollout.model.kv_cache import append_along

    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(2, 3, n, 4, generator=g) for n in (5, 1, 1, 1, 7, 1)]
    with mode():
        grown = parts[0]
        for new in parts[1:]:
            before = grown
            grown = append_along(grown, new, 2)
            # the same values as concatenation
            assert torch.equal(grown, torch.cat([before, new], dim=2))
        assert torch.equal(grown, torch.cat(parts, dim=2))
        # 5 + 1 -> a buffer of 12 slots; the next two steps (7, 8) write into it in place
        first = append_along(parts[0], parts[1], 2)
        assert first._kv_buffer.shape[2] == 12
        second = append_along(first, parts[2], 2)
        third = append_along(second, parts[3], 2)
        assert second.data_ptr() == first.data_ptr() == third.data_ptr()
        assert torch.equal(third, torch.cat(parts[:4], dim=2))
        # 8 + 7 = 15 > 12: a new buffer of 30 slots
        fourth = append_along(third, parts[4], 2)
        assert fourth.data_ptr() != third.data_ptr() and fourth._kv_buffer.shape[2] == 30
    # under autograd with a tensor that needs gradients: plain concatenation, differentiable
    leaf = parts[0].clone().requires_grad_(True)
    out = append_along(leaf, parts[1], 2)
    out.sum().backward()
    assert out._base is None and torch.equal(leaf.grad, torch.ones_like(leaf))
