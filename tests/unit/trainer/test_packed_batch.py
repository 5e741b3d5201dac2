"""A packed microbatch gives the same logprobs and gradients as the right-padded one."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.errors import SampleError
from replayrl.rollout.model.checkpoint import state_dict_arrays
from replayrl.rollout.model.config import default_config
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sample import TRACE_FIELDS, Sample
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.rollout.traces.trajectory import merge_turns
from replayrl.trainer.backends.torch_backend import response_logprobs
from replayrl.trainer.batching.batch import collate, collate_packed


@pytest.fixture(scope="module")
def model_and_samples():
    cfg = default_config(40)
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(5)
    engine = EmbeddedEngine(cfg, dtype=torch.float32)
    engine.load_weights(state_dict_arrays(model), version=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40, n).tolist() for n in (3, 9, 5, 12, 1)]  # odd lengths, > index_topk
    gens = engine.generate(prompts, SamplingParams(top_k=12), max_new_tokens=6, eos_token_id=2, seed=1,
                           traces=TRACE_FIELDS)
    samples = [Sample(sample_id=i, group_id=i, rollout_id=0, policy_version=0,
                      prompt_ids=np.array(p, np.int32),
                      **merge_turns(p, [g], [], sample_id=i).sample_fields())
               for i, (p, g) in enumerate(zip(prompts, gens))]
    return model, samples


@pytest.mark.parametrize("multiple", [1, 4])
def test_packed_equals_padded_with_every_replay(model_and_samples, multiple):
    model, samples = model_and_samples
    results = []
    for batch in (collate(samples, routing=True, indexer=True, support=True),
                  collate_packed(samples, routing=True, indexer=True, support=True,
                                 pad_to_multiple_of=multiple)):
        model.zero_grad()
        logp, out = response_logprobs(model, batch, 1.0, capture=True)
        (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
        results.append((logp.detach(), model.model.embed_tokens.weight.grad.clone(), batch))
    (lp, gp, padded), (lk, gk, packed) = results
    assert packed.tokens.shape[0] == 1 and packed.tokens.shape[1] % multiple == 0
    assert torch.equal(padded.targets, packed.targets)
    # the tokens at the predicting positions are the targets' predecessors in both layouts
    assert torch.equal(padded.tokens[padded.row, padded.pos + 1], packed.tokens[0, packed.pos + 1])
    assert torch.allclose(lp, lk, atol=2e-5) and torch.allclose(gp, gk, atol=2e-5)
    # and both reproduce the engine's (fp32, same weights) behaviour logprobs
    assert torch.allclose(lk, packed.rollout_logprobs, atol=1e-4)


def test_packed_batch_names_a_sample_missing_a_trace(model_and_samples):
    _, samples = model_and_samples
    import dataclasses
    broken = [samples[0], dataclasses.replace(samples[1], routed_experts=None)]
    with pytest.raises(SampleError, match="sample 1.*routed_experts"):
        collate_packed(broken, routing=True, indexer=False, support=True)
