"""LoRA on the LM head (``--lora-target-modules ...,lm_head``): the adapted head reads as
``W + (alpha / r) B A`` on both trainer paths (full logits through peft's forward, and the fused
chunked support-replay path that reads the weight), the engine merging the push computes the
trainer's merged policy, and a head tied to the embedding is refused before start."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.from_flags import build_config
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.errors import TrainerConfigError
from replayrl.trainer.lora import peft_adapter as lora
from replayrl.trainer.lora.run_check import check_run
from tests.backend_fixtures import decisive_checkpoint, lora_config, randomize_adapters, token_ids, traced_samples

pytest.importorskip("peft", reason="peft (the lora extra) is not installed")

TARGETS = "q_proj,lm_head"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = build_config({"model-indexer": False}).policy_config
    return decisive_checkpoint(tmp_path_factory.mktemp("init") / "model", cfg, seed=3)


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the backends set the process's threads


def test_the_adapted_head_multiplies_by_its_merged_weight_on_both_paths(checkpoint):
    backends = [TorchBackend(str(checkpoint), lora_config(lora_target_modules=TARGETS, logprobs_chunk_size=c),
                             list(VOCABULARY)) for c in (0, 5)]
    for backend in backends:
        randomize_adapters(backend.model, seed=7, scale=0.5)
    head = backends[0].model.lm_head
    by_hand = head.base_layer.weight + 2.0 * head.lora_B["default"].weight @ head.lora_A["default"].weight
    torch.testing.assert_close(lora.head_weight(head), by_hand, rtol=0, atol=1e-6)
    assert (by_hand - head.base_layer.weight).abs().max() > 0.1  # the adapter moves the head
    batch = collate(traced_samples(backends[0].model, len(VOCABULARY), adapted=True), routing=True,
                    indexer=False, support=True)
    full, fused = (b.preflight_logprobs(batch).logprobs for b in backends)
    torch.testing.assert_close(fused, full, rtol=0, atol=1e-5)  # chunked path = peft's forward


def test_the_engine_merges_the_head_adapter_into_the_trainers_policy(checkpoint):
    backend = TorchBackend(str(checkpoint), lora_config(lora_target_modules=TARGETS), list(VOCABULARY))
    cfg = backend.model_config
    engine = EmbeddedEngine(dataclasses.asdict(cfg), dtype=torch.float32)
    engine.load_weights({k: t.numpy() for k, t in backend.push_tensors(full=True).items()}, version=0)
    randomize_adapters(backend.model, seed=3, scale=0.5)
    push = backend.push_tensors(full=False)
    assert {"lm_head.weight.lora_A", "lm_head.weight.lora_B"} <= set(push)
    engine.load_weights({k: t.numpy() for k, t in push.items()}, version=1)
    ids, pos = token_ids(cfg.vocab_size)
    with torch.no_grad():
        got = engine.model(ids, pos).logits
        with lora.experts_adapted(backend.model):
            want = backend.model(ids, pos).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    embeddings = (m.model.embed_tokens.weight.detach().numpy() for m in (engine.model, backend.model))
    np.testing.assert_array_equal(*embeddings)  # the embedding is untouched by the head's adapter


def test_a_head_tied_to_the_embedding_is_refused_before_start():
    run = build_config({"lora-rank": 8, "lora-target-modules": TARGETS})
    check_run(run)  # the embedded default's head is untied
    tied = SimpleNamespace(trainer=run.trainer, hf_checkpoint=None,
                           policy_config=dataclasses.replace(run.policy_config, tie_word_embeddings=True))
    with pytest.raises(TrainerConfigError, match="tie_word_embeddings"):
        check_run(tied)
