"""A generate that names a min_version waits for a weight push still on its way (the trainer
pushes and goes on training; docs/design/version-clock.md#version-clock), and fails clearly when that push failed or
never came."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from replayrl.rollout.dispatch.engine_actor import EngineActor
from replayrl.rollout.engines.base import generations_from_columns
from replayrl.rollout.errors import EngineError, EngineNotReady
from replayrl.rollout.model.config import default_config
from replayrl.transport.array_bundle import pack_arrays

WEIGHTS = pack_arrays({"w": np.zeros(3, np.float32)})
PROMPT = [np.array([1, 3, 5, 6, 7, 2], np.int32)]
SAMPLING = {"temperature": 1.0, "top_k": 4, "top_p": 1.0, "min_p": 0.0}


def _actor(wait_s: float = 5.0) -> EngineActor:
    cfg = dataclasses.asdict(default_config(12))
    return EngineActor("tests.fake_engine:FixedDigitEngine", {"model_config": cfg}, [],
                       version_wait_s=wait_s)


def _generate(actor: EngineActor, min_version: int | None):
    return actor.generate(PROMPT, SAMPLING, max_new_tokens=2, eos_token_id=2, seed=0,
                          min_version=min_version)


async def test_generate_waits_for_the_named_version_then_serves_it():
    actor = _actor()
    await actor.load_weights(0, WEIGHTS)
    pending = asyncio.ensure_future(_generate(actor, 1))
    await asyncio.sleep(0.05)
    assert not pending.done()  # still at version 0
    await actor.load_weights(1, WEIGHTS)
    reply = await asyncio.wait_for(pending, 5)
    assert reply["version"] == 1
    # the fake engine answers the first digit for row 0: prompt[2] = 5, then EOS
    assert generations_from_columns(reply["generations"])[0].response_ids.tolist() == [5, 2]


async def test_a_version_already_served_does_not_wait():
    actor = _actor(wait_s=0.01)
    await actor.load_weights(3, WEIGHTS)
    assert (await _generate(actor, 2))["version"] == 3
    assert (await _generate(actor, None))["version"] == 3


async def test_a_failed_push_of_the_named_version_is_raised_to_the_waiting_generate():
    actor = _actor()
    await actor.load_weights(0, WEIGHTS)
    pending = asyncio.ensure_future(_generate(actor, 1))
    await asyncio.sleep(0.01)
    with pytest.raises(EngineError, match="empty weight push"):
        await actor.load_weights(1, pack_arrays({}))
    with pytest.raises(EngineError, match="version 1, whose load failed here: "
                                          "EngineInputError: load_weights: empty weight push"):
        await asyncio.wait_for(pending, 5)


async def test_a_push_that_never_comes_times_out_naming_the_version():
    actor = _actor(wait_s=0.05)
    await actor.load_weights(0, WEIGHTS)
    with pytest.raises(EngineNotReady, match="waited 0.05 s for weights of version 1; serving 0"):
        await _generate(actor, 1)
