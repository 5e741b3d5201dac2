"""Shared inputs of the megatron backend tests (in-process and torchrun workers): the embedded
default policy's checkpoint, and samples with support rows, routing and indexer traces captured
by the embedded torch model with its routers and indexers perturbed (so that replay differs from
the trainer's own choices)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from replayrl.rollout.model.checkpoint import save_pretrained
from replayrl.rollout.model.config import ModelConfig, default_config
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sample import Sample
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY

V = len(VOCABULARY)


def config() -> ModelConfig:
    """The embedded default (dense layer 0, MoE layers 1-3, indexer on layers 1 and 3)."""
    return default_config(V)


def write_checkpoint(directory: Path, seed: int = 3) -> Path:
    """The policy of ``config()`` initialised from ``seed``, saved as an HF directory."""
    model = Qwen3MoeForCausalLM(config())
    model.init_weights(seed)
    return save_pretrained(model, directory, tokens=list(VOCABULARY))


def perturbed(checkpoint: Path, scale: float = 0.05, seed: int = 7) -> Qwen3MoeForCausalLM:
    """The checkpoint's torch model with every router and indexer query weight perturbed by
    N(0, scale)."""
    from replayrl.rollout.model.loader import load_pretrained

    model, _ = load_pretrained(checkpoint, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "indexer.wq.weight")):
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def samples(engine: Qwen3MoeForCausalLM | None = None, seed: int = 0, lengths=((4, 3), (6, 2), (9, 4)),
            support_width: int = 4) -> list[Sample]:
    """Samples with support rows (the sampled id among ``support_width`` distinct candidates)
    and, when ``engine`` is given (the embedded model, or a family room model with or without
    an indexer), the routing and indexer key slots it chooses for every token but the last."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, r) in enumerate(lengths):
        prompt = rng.integers(0, V, p).astype(np.int32)
        response = rng.integers(0, V, r).astype(np.int32)
        support = np.full((r, 1 + support_width), -1, np.int32)
        for j, y in enumerate(response):
            others = rng.choice(np.setdiff1d(np.arange(V), [y]), support_width - 1, replace=False)
            support[j, 0], support[j, 1:] = y, rng.permutation(np.concatenate([[y], others]))
        routed = index = None
        if engine is not None:
            tokens = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None]
            with torch.no_grad():
                out_e = engine(tokens, torch.arange(tokens.shape[1])[None], capture=True)
            routed = out_e.routed_experts[0, :-1].numpy().astype(np.int32)
            if out_e.indexer_topk is not None:  # None: a family without an indexer
                index = out_e.indexer_topk[0, :-1].numpy().astype(np.int32)
        out.append(Sample(sample_id=i, group_id=0, rollout_id=0, policy_version=0,
                          prompt_ids=prompt, response_ids=response, loss_mask=np.ones(r, np.uint8),
                          rollout_logprobs=np.zeros(r, np.float32), sample_support=support,
                          routed_experts=routed, indexer_topk=index))
    return out
