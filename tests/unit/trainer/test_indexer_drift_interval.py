"""``--indexer-drift-interval``: the training forward computes the indexer's own top-k (only the
``indexer_drift_rate`` metric needs it under indexer replay) on every N-th update; the skipped
updates give the same logprobs, gradients and replayed keys, and log the drift as null."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.model import indexer as indexer_module
from replayrl.rollout.model.config import default_config
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sample import Sample
from replayrl.trainer.ranks.trainer_actor import TrainerActor
from tests.trainer_on_samples import (
    float_params,
    initial_checkpoint,
    restore_torch_threads,  # noqa: F401 (an autouse fixture: pytest finds it here)
    train_on,
    trainer_actor,
    two_groups_of_two,
)


def _model_and_replay():
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(default_config(44))
    model.init_weights(seed=0)
    ids = torch.randint(0, 44, (2, 40))
    pos = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        traced = model(ids, pos, capture=True)
    return model, ids, pos, traced.indexer_topk


def _count_scores(monkeypatch) -> list[int]:
    calls = [0]
    scores = indexer_module.Indexer.scores

    def counted(self, *args):
        calls[0] += 1
        return scores(self, *args)

    monkeypatch.setattr(indexer_module.Indexer, "scores", counted)
    return calls


def test_a_fully_replayed_forward_skips_the_own_topk_and_computes_the_same(monkeypatch):
    model, ids, pos, replay = _model_and_replay()
    calls = _count_scores(monkeypatch)
    full = model(ids, pos, indexer_topk=replay, capture=True)
    assert calls[0] == len(model.config.indexed_layers) and full.own_indexer_topk is not None
    skipped = model(ids, pos, indexer_topk=replay, capture=True, own_indexer=False)
    assert calls[0] == len(model.config.indexed_layers)  # no scores this time
    assert skipped.own_indexer_topk is None
    assert torch.equal(skipped.logits, full.logits)
    assert torch.equal(skipped.indexer_topk, full.indexer_topk)
    (g_full,) = torch.autograd.grad(full.logits.sum(), model.lm_head.weight)
    (g_skip,) = torch.autograd.grad(skipped.logits.sum(), model.lm_head.weight)
    assert torch.equal(g_full, g_skip)


def test_a_query_without_replay_still_gets_the_own_topk(monkeypatch):
    model, ids, pos, replay = _model_and_replay()
    replay = replay.clone()
    replay[1, 30] = -1  # a real query the engine never forwarded (e.g. a synthetic EOS)
    calls = _count_scores(monkeypatch)
    full = model(ids, pos, indexer_topk=replay, capture=True)
    skipped = model(ids, pos, indexer_topk=replay, capture=True, own_indexer=False)
    assert calls[0] == 2 * len(model.config.indexed_layers)
    assert torch.equal(skipped.logits, full.logits)
    assert torch.equal(skipped.indexer_topk, full.indexer_topk)
    # the row used there is the own choice, which the engine's trace did not give
    assert torch.equal(full.indexer_topk[1, 30], full.own_indexer_topk[1, 30])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return initial_checkpoint(tmp_path_factory.mktemp("ckpt"), 2, 2)


def _actor(checkpoint: str, **settings) -> TrainerActor:
    return trainer_actor(checkpoint, 2, 2, micro_batch_size=4, **settings)


def _samples(actor: TrainerActor) -> list[Sample]:
    return two_groups_of_two(actor, 6, 4)


async def test_drift_every_nth_update_and_the_same_weights(checkpoint):
    rows: dict[str, list[dict]] = {}
    weights = {}
    for interval in (1, 2):
        actor = _actor(checkpoint, indexer_drift_interval=interval)
        rows[interval] = [(await train_on(actor, _samples(actor)))[0] for _ in range(3)]
        weights[interval] = float_params(await actor.weights_digest())
    assert all(m["preflight_seconds"] == 0.0 for m in rows[2])  # fused: no preflight forward
    assert [m["indexer_drift_rate"] is None for m in rows[2]] == [False, True, False]
    assert all(m["indexer_drift_rate"] is not None for m in rows[1])
    assert [m["indexer_drift_rate"] for m in rows[2]][::2] == [m["indexer_drift_rate"] for m in rows[1]][::2]
    assert [m["indexer_flip_rate"] for m in rows[2]] == [m["indexer_flip_rate"] for m in rows[1]]
    for key, value in weights[1].items():
        assert np.array_equal(value, weights[2][key]), key
