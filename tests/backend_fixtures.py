"""Shared test helper: the setup the trainer backends' tests (torch, fsdp, LoRA, the model
families) build alike -- traced samples, the loss, the LoRA config, random adapters, one
optimizer step -- and the checks that an fsdp backend took the torch backend's step."""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch

from replayrl.rollout.model.checkpoint import save_pretrained
from replayrl.rollout.sample import Sample
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.trainer.config import TrainerConfig
from tests.model_helpers import decisive_model

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TRACE_FIELDS = ("routed_experts", "own_routed_experts", "indexer_topk", "own_indexer_topk")


def decisive_checkpoint(directory: Path, cfg, seed: int) -> Path:
    """Save :func:`tests.model_helpers.decisive_model` of policy config ``cfg`` (seed ``seed``,
    norm jitter 0.2: no near ties in routing or key choices) to ``directory`` with the embedded
    vocabulary; returns ``directory``."""
    save_pretrained(decisive_model(cfg, seed=seed, norm_jitter=0.2), directory, tokens=list(VOCABULARY))
    return directory


def traced_samples(model, vocab_size: int, prompt_len: int = 5, adapted: bool = False) -> list[Sample]:
    """Four samples of two groups (``rng = default_rng(0)``: prompts of ``prompt_len`` random
    ids in ``[3, vocab_size)``, responses of 3..6): the routing / indexer traces are ``model``'s
    own choices (int32; ``indexer_topk`` None for a model without an indexer), each response
    token's support (int32 ``[len(response), 4]``) its token and the next two ids (support
    replay); loss mask all ones, rollout logprobs -1. ``adapted``: traced inside
    :func:`replayrl.trainer.lora.peft_adapter.experts_adapted` (a LoRA policy's own choices)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(4):
        prompt = rng.integers(3, vocab_size, prompt_len).astype(np.int32)
        response = rng.integers(3, vocab_size, 3 + i).astype(np.int32)
        tokens = torch.from_numpy(np.r_[prompt, response][:-1].astype(np.int64))[None]
        if adapted:
            from replayrl.trainer.lora import peft_adapter as lora

            context = lora.experts_adapted(model)
        else:
            context = contextlib.nullcontext()
        with torch.no_grad(), context:
            traced = model(tokens, torch.arange(tokens.shape[1])[None], capture=True)
        support = np.stack([response, response, (response + 1) % vocab_size,
                            (response + 2) % vocab_size], axis=1)  # column 0: the sampled id
        out.append(Sample(sample_id=i, group_id=i // 2, rollout_id=0, policy_version=0,
                          prompt_ids=prompt, response_ids=response,
                          loss_mask=np.ones(len(response), np.uint8),
                          rollout_logprobs=np.full(len(response), -1.0, np.float32),
                          sample_support=support,
                          routed_experts=traced.routed_experts[0].numpy().astype(np.int32),
                          indexer_topk=None if traced.indexer_topk is None
                          else traced.indexer_topk[0].numpy().astype(np.int32)))
    return out


def signed_loss(logp: torch.Tensor) -> torch.Tensor:
    """``-(logp * linspace(-1, 1, len(logp))).sum()``: a scalar loss whose gradient pushes the
    first tokens' logprobs down and the last ones' up."""
    return -(logp * torch.linspace(-1.0, 1.0, len(logp))).sum()


def train_step(backend, batch) -> float:
    """One optimizer step of ``backend`` on ``batch`` with :func:`signed_loss`, clipped at 1.0;
    returns the gradient norm before clipping."""
    backend.zero_grad()
    backend.forward_backward(batch, signed_loss)
    return backend.clip_and_step(1.0)


def lora_config(**kw) -> TrainerConfig:
    """The tests' LoRA trainer config: rank 4, alpha 8 (scaling 2), lr 1e-2; ``kw`` overrides."""
    return TrainerConfig(**{"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2, **kw})


def randomize_adapters(model, seed: int = 0, scale: float = 0.05) -> None:
    """Nonzero ``B`` everywhere (peft initialises it to zero: the policy unchanged), drawn
    ``scale * N(0, 1)`` from a generator seeded ``seed`` in parameter-name order; a DTensor's
    local shard is written (one rank: the shard is all)."""
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                local = p.to_local() if isinstance(p, DTensor) else p
                local.copy_(scale * torch.randn(p.shape, generator=g))


def adapter_size_by_hand(model: torch.nn.Module, rank: int, targets) -> int:
    """``rank x (in + out)`` summed over every ``nn.Linear`` of ``model`` whose name ends with
    one of ``targets``: the parameter count LoRA adds to them."""
    return sum(rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)


def token_ids(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 11 random ids in ``[3, vocab_size)`` (generator seeded 1) and their
    positions ``0..10``, both int64 ``[3, 11]``."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab_size, (3, 11), generator=g), torch.arange(11).expand(3, 11)


def assert_fsdp_takes_the_torch_step(reference, fsdp, batch, atol: float, rel: float):
    """On ``batch``: the fsdp backend's preflight gives the torch ``reference``'s logprobs
    (within ``atol``) and the same replayed and own choices (:data:`TRACE_FIELDS`); one step of
    each with :func:`signed_loss` gives those logprobs again and the same gradient norm (within
    ``rel``). Returns the two preflights ``(want, got)``."""
    want, got = reference.preflight_logprobs(batch), fsdp.preflight_logprobs(batch)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=atol)
    for field in TRACE_FIELDS:
        if getattr(want, field) is None:  # a trace the model has none of (no indexer)
            assert getattr(got, field) is None, field
            continue
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    norms = []
    for backend in (reference, fsdp):
        backend.zero_grad()
        out = backend.forward_backward(batch, signed_loss, capture=True)
        torch.testing.assert_close(out.logprobs, want.logprobs, rtol=0, atol=atol)
        norms.append(backend.clip_and_step(1.0))
    assert norms[1] == pytest.approx(norms[0], rel=rel)
    return want, got


def assert_hf_save_gives_the_logits(backend, reference, directory) -> None:
    """``backend.save_hf(directory)`` (a family model's weights, gathered under fsdp) loads in
    transformers (float32, eager) and gives the torch ``reference``'s logits on a 7-token row
    (within 1e-4)."""
    import transformers

    backend.save_hf(directory)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([[1, 4, 5, 6, 7, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits,
                                   reference.model.eval()(ids, torch.arange(7)[None]).logits,
                                   rtol=0, atol=1e-4)


def assert_same_arrays(got: dict, want: dict, atol: float, keys=None) -> None:
    """``got`` holds ``want``'s names (and ``keys``', when given), each array within ``atol``."""
    assert set(got) == set(want) == set(want if keys is None else keys)
    for name, array in want.items():
        np.testing.assert_allclose(got[name], array, rtol=0, atol=atol, err_msg=name)


def assert_same_push(reference, fsdp, atol: float) -> None:
    """The fsdp backend's pushes (full and not) are the torch ``reference``'s
    (``push_tensors``), key for key in the same order, each tensor within ``atol``."""
    for full in (True, False):
        pushed, want = fsdp.push_tensors(full=full), reference.push_tensors(full=full)
        assert list(pushed) == list(want)
        for name, t in want.items():
            np.testing.assert_allclose(pushed[name].cpu().numpy(), t.cpu().numpy(), rtol=0,
                                       atol=atol, err_msg=name)
