"""No-grad forwards see every change of the expert weights (nothing stale is reused)."""
from __future__ import annotations

import torch

from replayrl.rollout.model.config import default_config
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM


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


def test_an_expert_no_token_reached_gets_a_zero_gradient_not_none():
    # the trainer's DDP runs without find_unused_parameters (trainer/backends/torch_backend.py):
    # that holds only while every trainable parameter is in every training forward's graph
    cfg = default_config(30)
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(0)
    tokens = torch.randint(0, 30, (2, 5), generator=torch.Generator().manual_seed(2))
    k = cfg.num_experts_per_tok
    assert cfg.num_experts > k  # some expert stays unreached
    # R3 replay sends every token of every MoE layer to experts 0 .. k-1
    replay = torch.arange(k).expand(2, 5, len(cfg.moe_layers), k).contiguous()
    out = model(tokens, torch.arange(5).expand_as(tokens), routed_experts=replay).logits
    out.square().mean().backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert [n for n, p in trainable.items() if p.grad is None] == []
    for layer in cfg.moe_layers:
        experts = model.model.layers[layer].mlp.experts
        for e, expert in enumerate(experts):
            grads = [p.grad for p in expert.parameters()]
            if e < k:
                assert all(g.abs().sum() > 0 for g in grads), (layer, e)
            else:
                assert all(torch.count_nonzero(g) == 0 for g in grads), (layer, e)
    # the frozen indexer is no trainable parameter at all: DDP skips it
    assert not any(".indexer." in n for n in trainable)


def _storages(model):
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


def test_reused_stacks_serve_no_grad_forwards_until_a_weight_changes():
    # the engine's model (reuse_expert_stacks): the experts' weights are views into the stacks
    # the grouped matmuls read, so a push (copy_) updates the stacks and nothing is rebuilt
    model = Qwen3MoeForCausalLM(default_config(30))
    model.init_weights(0)
    reference = Qwen3MoeForCausalLM(default_config(30))  # never reuses: stacks every forward
    reference.load_state_dict(model.state_dict())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.reuse_expert_stacks()
    tokens = torch.randint(0, 30, (3, 6), generator=torch.Generator().manual_seed(3))
    block = model.model.layers[1].mlp
    stack = block.stack_cache[("down_proj",)][2]
    # one copy of the experts: every expert weight lives in its stack's memory, and the
    # model's distinct storages add up to its parameters' bytes
    for e in block.experts:
        assert e.down_proj.weight.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    assert sum(_storages(model).values()) == param_bytes
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))
    assert block.stack_cache[("down_proj",)][2] is stack  # reused, not rebuilt
    with torch.no_grad():  # a weight push: copy_ into the parameters
        for p, q in zip(model.parameters(), reference.parameters()):
            q.copy_(p * 1.5)
            p.copy_(q)
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))
    assert block.stack_cache[("down_proj",)][2] is stack  # the push wrote into it
    with torch.no_grad():  # a replaced Parameter: stacked anew, then reused
        e = model.model.layers[1].mlp.experts[0]
        e.up_proj.weight = torch.nn.Parameter(e.up_proj.weight * -1.0)
        f = reference.model.layers[1].mlp.experts[0]
        f.up_proj.weight = torch.nn.Parameter(f.up_proj.weight * -1.0)
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))
    restacked = block.stack_cache[("gate_proj", "up_proj")][2]
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))
    assert block.stack_cache[("gate_proj", "up_proj")][2] is restacked
    with torch.no_grad():  # ... until that replaced weight changes in place
        e.up_proj.weight.add_(0.25)
        f.up_proj.weight.add_(0.25)
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))
    # under autograd nothing is reused: the experts get their gradients
    out = model(tokens, torch.arange(6).expand_as(tokens)).logits
    out.square().mean().backward()
    assert block.experts[0].down_proj.weight.grad is not None
    model.reuse_expert_stacks(False)
    assert block.stack_cache is None
    assert torch.equal(_logits(model, tokens), _logits(reference, tokens))
