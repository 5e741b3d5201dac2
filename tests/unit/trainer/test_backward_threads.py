"""``--trainer-backward-threads``: the backward passes run on that many torch threads, the
forwards and everything after the update on ``--trainer-torch-threads``; the step moves the
weights as a one-thread step does, up to float rounding, and the same way every run.

Drives a real in-process TrainerActor (its ``train``) with a fake manager and clock, as
tests/unit/trainer/test_rs_baseline.py does; the thread counts are read inside the backend's
forward and backward.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.sample import Sample
from replayrl.tools.run.from_flags import build_config
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.ranks.trainer_actor import TrainerActor
from tests.trainer_on_samples import (
    float_params,
    initial_checkpoint,
    restore_torch_threads,  # noqa: F401 (an autouse fixture: pytest finds it here)
    train_on,
    trainer_actor,
    two_groups_of_two,
)

RESPONSE_LEN = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return initial_checkpoint(tmp_path_factory.mktemp("ckpt"), 2, 2)


def _actor(checkpoint: str, **settings) -> TrainerActor:
    return trainer_actor(checkpoint, 2, 2, micro_batch_size=2, **settings)


def _samples(actor: TrainerActor) -> list[Sample]:
    return two_groups_of_two(actor, 4, RESPONSE_LEN)


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


async def test_the_backward_runs_on_its_threads_and_the_weights_move_as_with_one(checkpoint):
    plain = _actor(checkpoint, preflight="always")
    plain_seen = _watch_threads(plain)
    await train_on(plain, _samples(plain))
    assert plain_seen == {"forward": [1, 1], "backward": [1, 1]}

    actor = _actor(checkpoint, preflight="always", backward_threads=2)
    seen = _watch_threads(actor)
    metrics, _ = await train_on(actor, _samples(actor))
    assert metrics["trained_groups"] == 2 and actor.version == 1
    assert seen == {"forward": [1, 1], "backward": [2, 2]}  # two microbatches of two samples
    assert torch.get_num_threads() == 1  # back to --trainer-torch-threads after the update
    again = _actor(checkpoint, preflight="always", backward_threads=2)
    await train_on(again, _samples(again))
    assert await again.weights_digest() == await actor.weights_digest()  # the same every run
    before = float_params(await _actor(checkpoint).weights_digest())
    a, b = float_params(await plain.weights_digest()), float_params(await actor.weights_digest())
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


def test_the_backward_switches_only_to_another_thread_count():
    # (torch threads, backward threads) -> the count the backward switches to, 0 for none
    cases = {(1, 0): 0, (1, 1): 0, (1, 2): 2, (2, 2): 0, (2, 1): 1, (3, 0): 0}
    for (torch_threads, backward), want in cases.items():
        cfg = TrainerConfig(torch_threads=torch_threads, backward_threads=backward)
        assert cfg.backward_switch_threads == want, (torch_threads, backward)
