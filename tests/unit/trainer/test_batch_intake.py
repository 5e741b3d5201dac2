"""How a step takes its batch: the version clock's staleness check travels while the batch
decodes (trainer/ranks/trainer_actor.py), and neither its order nor its verdict changes.

Each test drives a real in-process TrainerActor's ``train`` on hand-built samples (ids 0-3,
policy version 0) with a fake rollout manager and a fake clock that records what it was asked.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from replayrl.actors.errors import StaleSample
from replayrl.rollout.errors import SampleError
from replayrl.rollout.sample import samples_to_columns
from replayrl.trainer.ranks import trainer_actor as trainer_actor_module
from tests.fakes import FakeProxy
from tests.trainer_on_samples import (
    float_params,
    initial_checkpoint,
    restore_torch_threads,  # noqa: F401 (an autouse fixture: pytest finds it here)
    trainer_actor,
    two_groups_of_two,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return initial_checkpoint(tmp_path_factory.mktemp("ckpt"), 2, 2)


def _connect(actor, columns: dict, verdict=None) -> list:
    """Point ``actor`` at a manager that hands over ``columns`` and a clock that records each
    ``check_samples`` call (and raises ``verdict``, when given); returns the record."""
    asked: list = []

    async def take_batch(rollout_id):
        return columns

    async def check_samples(ids, versions):
        asked.append((list(ids), list(versions)))
        if verdict is not None:
            raise verdict
        return actor.version

    async def set_trainer_version(version):
        return version

    clock = FakeProxy(check_samples=check_samples, set_trainer_version=set_trainer_version)
    proxies = {"rollout_manager": FakeProxy(take_batch=take_batch), "version_clock": clock}
    actor.proxy = lambda name, timeout=None: proxies[name]
    return asked


async def test_the_clock_is_asked_once_with_the_batchs_ids_and_versions(checkpoint):
    actor = trainer_actor(checkpoint, 2, 2, micro_batch_size=4)
    samples = two_groups_of_two(actor, 3, 2)
    asked = _connect(actor, samples_to_columns(samples))
    metrics = await actor.train(0)
    assert asked == [([0, 1, 2, 3], [0, 0, 0, 0])]  # the hand-built samples' ids and versions
    assert metrics["trainer_version"] == 1 and metrics["skipped"] == 0


async def test_a_stale_verdict_stops_the_step_before_anything_is_applied(checkpoint):
    actor = trainer_actor(checkpoint, 2, 2, micro_batch_size=4)
    before = float_params(await actor.weights_digest())
    _connect(actor, samples_to_columns(two_groups_of_two(actor, 3, 2)),
             verdict=StaleSample("sample 0 at v0 outside the window"))
    with pytest.raises(StaleSample, match="sample 0 at v0"):
        await actor.train(0)
    after = float_params(await actor.weights_digest())
    assert actor.version == 0
    assert all(np.array_equal(before[k], after[k]) for k in before)


async def test_a_batch_that_does_not_decode_is_named_before_the_clocks_verdict(checkpoint):
    actor = trainer_actor(checkpoint, 2, 2, micro_batch_size=4)
    columns = samples_to_columns(two_groups_of_two(actor, 3, 2))
    columns["loss_mask"] = columns["loss_mask"][:-1]  # 7 rows for 4 responses of 2 tokens
    asked = _connect(actor, columns, verdict=StaleSample("stale as well"))
    with pytest.raises(SampleError, match="loss_mask"):
        await actor.train(0)
    # the check sent beside the decode was dropped, its error retrieved, before the decode's
    # error left the step: nothing of the step is left running
    assert asked == [([0, 1, 2, 3], [0, 0, 0, 0])]
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    assert actor.version == 0


async def test_the_check_is_sent_before_the_decode_ends(checkpoint, monkeypatch):
    actor = trainer_actor(checkpoint, 2, 2, micro_batch_size=4)
    events: list[str] = []
    decode = trainer_actor_module.samples_from_columns

    def traced_decode(*args, **kwargs):
        events.append("decode start")
        out = decode(*args, **kwargs)
        events.append("decode end")
        return out

    monkeypatch.setattr(trainer_actor_module, "samples_from_columns", traced_decode)
    asked = _connect(actor, samples_to_columns(two_groups_of_two(actor, 3, 2)))
    clock = actor.proxy("version_clock")
    check = clock._methods["check_samples"]

    async def traced_check(ids, versions):
        events.append("check sent")
        return await check(ids, versions)

    clock._methods["check_samples"] = traced_check
    await actor.train(0)
    assert events == ["check sent", "decode start", "decode end"] and len(asked) == 1


async def test_a_batch_that_fails_after_its_decode_leaves_no_check_running(checkpoint):
    actor = trainer_actor(checkpoint, 2, 2, micro_batch_size=4)
    samples = two_groups_of_two(actor, 3, 2)
    columns = samples_to_columns(samples)
    # per-sample nested lists: Sample converts them, but they have no wire form to measure
    columns["sample_support"] = [np.zeros((len(s.response_ids), 2), np.int32).tolist()
                                 for s in samples]
    _connect(actor, columns, verdict=StaleSample("stale as well"))
    with pytest.raises(SampleError, match="sample_support"):
        await actor.train(0)
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    assert actor.version == 0
