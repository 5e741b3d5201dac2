"""Shared test helper: a real in-process TrainerActor trained on hand-built samples, its
rollout manager and version clock replaced by fakes (tests/fakes.py), as the RS-baseline and
backward-threads tests drive it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from replayrl.rollout.sample import Sample, samples_to_columns
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.ranks.trainer_actor import TrainerActor
from tests.fakes import FakeProxy


def initial_checkpoint(directory: Path, n_samples_per_prompt: int, rollout_batch_size: int) -> str:
    """The embedded default's initial checkpoint of a run with these batch settings, written
    under ``directory``."""
    config = build_config({"n-samples-per-prompt": n_samples_per_prompt,
                           "rollout-batch-size": rollout_batch_size})
    return str(write_initial_checkpoint(config, directory / "init"))


def trainer_actor(checkpoint: str, n_samples_per_prompt: int, rollout_batch_size: int,
                  micro_batch_size: int, **settings) -> TrainerActor:
    """An in-process TrainerActor on ``checkpoint`` (no engines) with the embedded vocabulary,
    support replay off (hand-built samples carry no sampler support) and ``settings`` (keyword
    fields of :class:`TrainerConfig`)."""
    cfg = TrainerConfig(use_support_replay=False, micro_batch_size=micro_batch_size, **settings)
    return TrainerActor(checkpoint, cfg.to_dict(), n_samples_per_prompt=n_samples_per_prompt,
                        engines=[], rollout_batch_size=rollout_batch_size,
                        vocab_tokens=list(VOCABULARY))


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Autouse in a test module that imports it: the trainer backend sets the process's torch
    threads; put them back after each test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def own_trace_sample(actor: TrainerActor, sample_id: int, group_id: int, prompt: np.ndarray,
                     response: np.ndarray, reward: float, logprob_shift: float = 0.0) -> Sample:
    """A sample with the actor's model's own routing / indexer traces and, as its rollout
    logprobs, the trainer's own logprobs plus ``logprob_shift`` nats per token (0: ratio 1)."""
    tokens = torch.from_numpy(np.r_[prompt, response][:-1].astype(np.int64))[None]
    with torch.no_grad():
        traced = actor.backend.model(tokens, torch.arange(tokens.shape[1])[None], capture=True)
    fields = dict(sample_id=sample_id, group_id=group_id, rollout_id=0, policy_version=0,
                  prompt_ids=prompt, response_ids=response,
                  loss_mask=np.ones(len(response), np.uint8),
                  routed_experts=traced.routed_experts[0].numpy().astype(np.int32),
                  indexer_topk=traced.indexer_topk[0].numpy().astype(np.int32))
    probe = Sample(**fields, rollout_logprobs=np.zeros(len(response), np.float32))
    actor.preflight([probe])
    own = actor.cache.peek(sample_id).numpy()
    actor.cache.clear()
    return Sample(**fields, reward=reward, rollout_logprobs=own + logprob_shift)


def two_groups_of_two(actor: TrainerActor, prompt_len: int, response_len: int) -> list[Sample]:
    """Four samples (two groups of two, rewards 0 / 1 each; random tokens of seed 0) with the
    model's own traces and its own logprobs as the rollout's (:func:`own_trace_sample`)."""
    rng = np.random.default_rng(0)
    return [own_trace_sample(actor, i, i // 2, rng.integers(0, 40, prompt_len).astype(np.int32),
                             rng.integers(0, 40, response_len).astype(np.int32), float(i % 2))
            for i in range(4)]


async def train_on(actor: TrainerActor, samples: list[Sample]) -> tuple[dict, list[int]]:
    """``actor.train(0)`` on ``samples`` with a fake manager and clock; returns the metrics and
    the versions the trainer reported to the clock."""
    reported: list[int] = []

    async def take_batch(rollout_id):
        return samples_to_columns(samples)

    async def check_samples(ids, versions):
        return actor.version

    async def set_trainer_version(version):
        reported.append(version)
        return version

    clock = FakeProxy(check_samples=check_samples, set_trainer_version=set_trainer_version)
    clock._methods["with_timeout"] = lambda timeout: clock
    proxies = {"rollout_manager": FakeProxy(take_batch=take_batch), "version_clock": clock}
    actor.proxy = lambda name, timeout=None: proxies[name]
    return await actor.train(0), reported


def float_params(digest: dict) -> dict[str, np.ndarray]:
    """The float32 weights in a :meth:`TrainerActor.weights_digest`."""
    return {k: np.frombuffer(v, np.float32) for k, v in digest.items() if k.startswith("param/")}


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two :func:`float_params` results."""
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)
