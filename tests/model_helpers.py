"""Shared test helper: a model whose routing and attention choices are decisive."""
from __future__ import annotations

import torch

from replayrl.rollout.model import Qwen3MoeForCausalLM


def decisive_model(cfg, seed: int, norm_jitter: float = 0.0) -> Qwen3MoeForCausalLM:
    """Deterministic weights scaled up 5x from the 0.02 init (so top-k choices are not near ties);
    norm weights get ``norm_jitter * N(0, 1)`` added from a generator seeded ``seed + 1``."""
    m = Qwen3MoeForCausalLM(cfg)
    m.init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                if norm_jitter:
                    p.add_(norm_jitter * torch.randn(p.shape, generator=g))
            else:
                p.mul_(5.0)
    return m
