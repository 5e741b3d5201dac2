"""No-grad forwards see every change of the expert weights (nothing stale is reused)."""
from __future__ import annotations

import torch

from rollout.model.config import default_config
from rollout.model.qwen3_moe import Qwen3MoeForCausalLM


def _logits(model, tokens):
    with torch.inference_mode():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens)).logits


def test_a_weight_changed_in_place_or_replaced_is_seen_by_the_next_no_grad_forward():
    model = Qwen3MoeForCausalLM(default_config(30))
    model.init_weights(0)
    tokens = torch.randint(0, 30, (3, 6), generator=torch.Generator().manual_seed(0))
    _logits(model, tokens)  # fills the cache
    reference = Qwen3MoeForCausalLM(default_config(30))
    reference.init_weights(0)
    with torch.no_grad():  # in place, as a weight push / optimizer step does
        for m in (model, reference):
            for e in m.model.layers[1].mlp.experts:
                e.down_proj.weight.mul_(3.0)
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))
    with torch.no_grad():  # a replaced Parameter (a loader that assigns new tensors)
        for m in (model, reference):
            e = m.model.layers[2].mlp.experts[0]
            e.gate_proj.weight = torch.nn.Parameter(e.gate_proj.weight * -2.0)
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))
    fresh = Qwen3MoeForCausalLM(default_config(30))  # never cached, same weights
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(_logits(model, tokens), _logits(fresh, tokens))


def test_a_fused_adamw_step_is_seen_by_the_next_no_grad_forward():
    # fused AdamW writes the parameters in place without bumping their version counters, so
    # nothing derived from the weights may be cached across forwards keyed by those counters
    model = Qwen3MoeForCausalLM(default_config(30))
    model.init_weights(0)
    tokens = torch.randint(0, 30, (3, 6), generator=torch.Generator().manual_seed(1))
    before = _logits(model, tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    out = model(tokens, torch.arange(6).expand_as(tokens)).logits
    out.square().mean().backward()
    optimizer.step()
    fresh = Qwen3MoeForCausalLM(default_config(30))
    fresh.load_state_dict(model.state_dict())
    after = _logits(model, tokens)
    assert not torch.equal(after, before) and torch.equal(after, _logits(fresh, tokens))
