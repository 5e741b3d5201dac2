"""``--trainer-backward-threads``: the backward passes run on that many torch threads, the
forwards and everything after the update on ``--trainer-torch-threads``, and the step moves the
weights as a one-thread step does, up to float rounding.

Drives a real in-process TrainerActor (its ``train``) with a fake manager and clock, as
tests/unit/trainer/test_rs_baseline.py does; the thread counts are read inside the backend's
forward and backward.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.sample import Sample, samples_to_columns
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.config import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.trainer_actor import TrainerActor
from tests.fakes import FakeProxy

RESPONSE_LEN = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = build_config({"n-samples-per-prompt": 2, "rollout-batch-size": 2})
    return str(write_initial_checkpoint(config, tmp_path_factory.mktemp("ckpt") / "init"))


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the trainer backend sets the process's threads


def _actor(checkpoint: str, **settings) -> TrainerActor:
    cfg = TrainerConfig(use_support_replay=False, micro_batch_size=2, **settings)
    return TrainerActor(checkpoint, cfg.to_dict(), n_samples_per_prompt=2, engines=[],
                        rollout_batch_size=2, vocab_tokens=list(VOCABULARY))


def _samples(actor: TrainerActor) -> list[Sample]:
    """Four samples (two groups of two, rewards 1 / 0 each) with the model's own traces and
    its own logprobs as the rollout's."""
    model, rng = actor.backend.model, np.random.default_rng(0)
    out = []
    for i in range(4):
        prompt = rng.integers(0, 40, 4).astype(np.int32)
        response = rng.integers(0, 40, RESPONSE_LEN).astype(np.int32)
        tokens = torch.from_numpy(np.r_[prompt, response][:-1].astype(np.int64))[None]
        with torch.no_grad():
            traced = model(tokens, torch.arange(tokens.shape[1])[None], capture=True)
        fields = dict(sample_id=i, group_id=i // 2, rollout_id=0, policy_version=0,
                      prompt_ids=prompt, response_ids=response,
                      loss_mask=np.ones(RESPONSE_LEN, np.uint8),
                      routed_experts=traced.routed_experts[0].numpy().astype(np.int32),
                      indexer_topk=traced.indexer_topk[0].numpy().astype(np.int32))
        probe = Sample(**fields, rollout_logprobs=np.zeros(RESPONSE_LEN, np.float32))
        actor.preflight([probe])
        own = actor.cache.peek(i).numpy()
        actor.cache.clear()
        out.append(Sample(**fields, reward=float(i % 2), rollout_logprobs=own))
    return out


async def _train(actor: TrainerActor, samples: list[Sample]) -> dict:
    async def take_batch(rollout_id):
        return samples_to_columns(samples)

    async def check_samples(ids, versions):
        return actor.version

    async def set_trainer_version(version):
        return version

    clock = FakeProxy(check_samples=check_samples, set_trainer_version=set_trainer_version)
    clock._methods["with_timeout"] = lambda timeout: clock
    proxies = {"rollout_manager": FakeProxy(take_batch=take_batch), "version_clock": clock}
    actor.proxy = lambda name, timeout=None: proxies[name]
    return await actor.train(0)


def _watch_threads(actor: TrainerActor) -> dict[str, list[int]]:
    """Record ``torch.get_num_threads()`` at every training forward and backward."""
    seen: dict[str, list[int]] = {"forward": [], "backward": []}
    backend = actor.backend
    forward, backward = backend.train_logprobs, backend.backward

    def train_logprobs(batch):
        seen["forward"].append(torch.get_num_threads())
        return forward(batch)

    def spy_backward(loss):
        seen["backward"].append(torch.get_num_threads())
        return backward(loss)

    backend.train_logprobs, backend.backward = train_logprobs, spy_backward
    return seen


def _params(digest: dict) -> dict[str, np.ndarray]:
    return {k: np.frombuffer(v, np.float32) for k, v in digest.items() if k.startswith("param/")}


async def test_the_backward_runs_on_its_threads_and_the_weights_move_as_with_one(checkpoint):
    plain = _actor(checkpoint, preflight="always")
    plain_seen = _watch_threads(plain)
    await _train(plain, _samples(plain))
    assert plain_seen == {"forward": [1, 1], "backward": [1, 1]}

    actor = _actor(checkpoint, preflight="always", backward_threads=2)
    seen = _watch_threads(actor)
    metrics = await _train(actor, _samples(actor))
    assert metrics["trained_groups"] == 2 and actor.version == 1
    assert seen == {"forward": [1, 1], "backward": [2, 2]}  # two microbatches of two samples
    assert torch.get_num_threads() == 1  # back to --trainer-torch-threads after the update
    before = _params(await _actor(checkpoint).weights_digest())
    a, b = _params(await plain.weights_digest()), _params(await actor.weights_digest())
    moved = max(float(np.abs(a[k] - before[k]).max()) for k in a)
    assert moved > 1e-4  # one AdamW step moves a weight by about --lr (3e-4)
    # the same step up to the rounding of a reduction split over two threads (AdamW divides
    # by sqrt(v) + 1e-6, so a rounding difference of a tiny gradient moves a weight by < 1e-6)
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-5


def test_the_peer_bench_prints_the_backward_threads_of_replayrls_side():
    from replayrl.tools.bench.peer import settings_table

    def threads_row(settings):
        return next(line for line in settings_table(build_config(settings)).splitlines()
                    if line.startswith("| threads"))

    assert "engine 1 + trainer 1 (its backward 2: --trainer-backward-threads) (one process each)" \
        in threads_row({"trainer-backward-threads": 2})
    assert "backward" not in threads_row({}) and "backward" not in threads_row(
        {"trainer-backward-threads": 1})
