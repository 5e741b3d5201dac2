"""The trainer itself refuses samples lacking a trace an enabled replay needs, and a replay with
nothing to replay is shown as n/a, never as 0 flips."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.errors import MissingTraceError, SampleError
from replayrl.rollout.sample import Sample
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint
from replayrl.tools.run.metrics import progress_status
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.ranks.trainer_actor import TrainerActor


@pytest.fixture
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the trainer backend sets the process's threads


def _actor(tmp_path, **config) -> TrainerActor:
    checkpoint = write_initial_checkpoint(build_config({}), tmp_path / "ckpt")
    return TrainerActor(str(checkpoint), TrainerConfig(**config).to_dict(), n_samples_per_prompt=2,
                        engines=[], rollout_batch_size=1, vocab_tokens=list(VOCABULARY))


def _sample(sample_id: int, model=None, *, routing: bool = False, indexer: bool = False) -> Sample:
    """Prompt of 4 and response of 3 tokens with a support row per token (the sampled id is its
    only candidate); routing / indexer traces are the model's own choices when asked for."""
    prompt = np.array([1, 10, 20, 30], np.int32)
    response = np.array([5, 6, 7], np.int32)
    traces = {}
    if routing or indexer:
        tokens = torch.from_numpy(np.r_[prompt, response][:-1].astype(np.int64))[None]
        with torch.no_grad():
            out = model(tokens, torch.arange(tokens.shape[1])[None], capture=True)
        if routing:
            traces["routed_experts"] = out.routed_experts[0].numpy().astype(np.int32)
        if indexer:
            traces["indexer_topk"] = out.indexer_topk[0].numpy().astype(np.int32)
    return Sample(sample_id=sample_id, group_id=0, rollout_id=0, policy_version=0,
                  prompt_ids=prompt, response_ids=response, loss_mask=np.ones(3, np.uint8),
                  rollout_logprobs=np.zeros(3, np.float32),
                  sample_support=np.stack([response, response], axis=1), **traces)


def test_preflight_refuses_samples_without_routing_or_indexer_traces(tmp_path, _restore_threads):
    actor = _actor(tmp_path)  # every replay on (the defaults)
    model = actor.backend.model
    assert actor.required_traces == ("sample_support", "routed_experts", "indexer_topk")
    with pytest.raises(MissingTraceError, match=r"sample 7: field 'routed_experts': absent, but "
                                                r"--use-routing-replay is on") as info:
        actor.preflight([_sample(6, model, routing=True, indexer=True), _sample(7)])
    assert isinstance(info.value, SampleError) and info.value.sample_id == 7
    with pytest.raises(MissingTraceError, match=r"sample 3: field 'indexer_topk': absent, but "
                                                r"--use-indexer-replay is on"):
        actor.preflight([_sample(3, model, routing=True)])
    assert actor.cache.peak_bytes == 0  # refused before any forward (sample 6 is not cached)


def test_traced_samples_report_flip_rates_and_untraced_replays_report_none(tmp_path, _restore_threads):
    actor = _actor(tmp_path)
    rates = actor.preflight([_sample(1, actor.backend.model, routing=True, indexer=True)])
    # traces are the model's own choices at these weights: nothing flips
    assert rates["routing_flip_rate"] == [0.0] and rates["indexer_flip_rate"] == [0.0]
    off = _actor(tmp_path, use_routing_replay=False, use_indexer_replay=False)
    assert off.required_traces == ("sample_support",)
    assert not any(k.endswith("_flip_rate") for k in off.preflight([_sample(2)]))


def test_progress_line_shows_a_missing_flip_rate_as_n_a_not_zero():
    row = {"reward_mean": 0.5, "train_rollout_logprob_abs_diff": 0.01, "staleness_mean": 1.0,
           "step_seconds": 0.25}
    assert "flips n/a/n/a " in progress_status(row)
    assert "flips 0/n/a " in progress_status({**row, "routing_flip_rate": 0.0})
    assert "flips 1/0 " in progress_status({**row, "routing_flip_rate": 1.0,
                                                        "indexer_flip_rate": 0.0})
