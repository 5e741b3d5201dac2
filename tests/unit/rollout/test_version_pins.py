"""A weight push that arrives between the turns of multi-turn episodes (miles#2589's class).

The engine actor holds such a load until the episodes of the older version released their
version pin, so every trajectory comes from one policy and the rollout does not fail; a pin
that lapsed anyway makes the rollout manager generate the batch again, whole, at the new
version and count it (docs/design/version-clock.md#version-clock). Everything runs in this process: a real
EngineActor and RolloutManager joined by a forwarding stand-in for the actor proxy.
"""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from replayrl.rollout.dispatch.engine_actor import EngineActor
from replayrl.rollout.dispatch.manager import RolloutManager
from replayrl.rollout.errors import EngineInputError, EngineNotReady
from replayrl.rollout.model.config import default_config
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import engine_kwargs, run_required_traces, write_initial_checkpoint
from replayrl.transport.array_bundle import pack_arrays

WEIGHTS = pack_arrays({"w": np.zeros(3, np.float32)})
PROMPT = [np.array([1, 3, 5, 6, 7, 2], np.int32)]
SAMPLING = {"temperature": 1.0, "top_k": 4, "top_p": 1.0, "min_p": 0.0}
GROUPS, N = 2, 2  # prompt groups per rollout, trajectories per group: one engine, one batch


def _actor(**kwargs) -> EngineActor:
    cfg = dataclasses.asdict(default_config(12))
    return EngineActor("tests.fake_engine:FixedDigitEngine", {"model_config": cfg}, [], **kwargs)


def _turn(actor: EngineActor, pin: str | None = None):
    return actor.generate(PROMPT, SAMPLING, max_new_tokens=2, eos_token_id=2, seed=0, pin=pin)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# ----------------------------------------------------------------------------- the engine actor


async def test_a_load_waits_for_an_older_pin_and_the_pinned_turns_keep_their_version():
    actor = _actor()
    await actor.load_weights(0, WEIGHTS)
    assert await actor.open_pin("a") == 0
    push = asyncio.ensure_future(actor.load_weights(1, WEIGHTS))
    await _settle()
    assert not push.done() and actor.engine.version == 0
    assert (await _turn(actor, "a"))["version"] == 0  # the episode's next turn: still 0
    assert await actor.release_pin("a") is True
    await asyncio.wait_for(push, 5)
    assert actor.engine.version == 1
    assert await actor.release_pin("a") is False  # idempotent


async def test_without_pins_a_load_never_suspends():
    """The single-turn path: the load runs to its end in one step, as before pins existed."""
    actor = _actor()
    load = actor.load_weights(0, WEIGHTS)
    with pytest.raises(StopIteration):
        load.send(None)
    assert actor.engine.version == 0


async def test_a_new_pin_waits_for_a_pending_load_and_the_next_rollout_gets_its_version():
    """The overlap loop's order: rollout k's episodes hold version 0, the push of version 1
    arrives, rollout k + 1 asks for min_version 1. Nothing deadlocks: the old episodes finish,
    the load lands, the new episodes start on version 1."""
    actor = _actor()
    await actor.load_weights(0, WEIGHTS)
    await actor.open_pin("old")
    push = asyncio.ensure_future(actor.load_weights(1, WEIGHTS))
    late = asyncio.ensure_future(actor.open_pin("new"))  # no min_version: still waits for the load
    nxt = asyncio.ensure_future(actor.open_pin("next", 1))
    await _settle()
    assert not (push.done() or late.done() or nxt.done())
    assert (await _turn(actor, "old"))["version"] == 0
    await actor.release_pin("old")
    assert await asyncio.wait_for(late, 5) == 1
    assert await asyncio.wait_for(nxt, 5) == 1
    await push
    assert actor.pins.held() == {"new": 1, "next": 1}


async def test_loads_held_by_a_pin_land_in_arrival_order():
    actor = _actor()
    await actor.load_weights(0, WEIGHTS)
    await actor.open_pin("a")
    first = asyncio.ensure_future(actor.load_weights(1, WEIGHTS))
    second = asyncio.ensure_future(actor.load_weights(2, WEIGHTS))
    await _settle()
    await actor.release_pin("a")
    await asyncio.wait_for(asyncio.gather(first, second), 5)  # 2 before 1 would be refused
    assert actor.engine.version == 2


async def test_a_pin_whose_holder_went_silent_lapses_and_the_load_goes_on():
    actor = _actor(pin_lease_s=0.05)
    await actor.load_weights(0, WEIGHTS)
    await actor.open_pin("silent")
    await asyncio.wait_for(actor.load_weights(1, WEIGHTS), 5)
    assert actor.engine.version == 1 and actor.pins.lapsed == 1
    assert actor.pins.held() == {}
    assert (await _turn(actor, "silent"))["version"] == 1  # served, and the reply says at what
    assert await actor.release_pin("silent") is False


async def test_pin_errors():
    actor = _actor()
    with pytest.raises(EngineNotReady, match="open_pin before the first weight load"):
        await actor.open_pin("a")
    await actor.load_weights(0, WEIGHTS)
    await actor.open_pin("a")
    with pytest.raises(EngineInputError, match="pin 'a' is already held"):
        await actor.open_pin("a")
    with pytest.raises(EngineInputError, match="pin must be a non-empty str"):
        await actor.open_pin("")
    with pytest.raises(EngineInputError, match="lease_s must be a number > 0"):
        _actor(pin_lease_s=0)


# ----------------------------------------------------------------------------- the rollout manager


class PushBetweenTurns:
    """The engine actor as the manager's proxy sees it, with the trainer's push of version 1
    arriving (sent, not awaited) after the first turn was served and before the second."""

    def __init__(self, engine: EngineActor) -> None:
        self._engine = engine
        self.turns = 0
        self.push: asyncio.Future | None = None

    def __getattr__(self, method: str):
        return getattr(self._engine, method)

    async def generate(self, *args, **kwargs) -> dict:
        self.turns += 1
        if self.turns == 2:
            self.push = asyncio.ensure_future(self._engine.load_weights(1, WEIGHTS))
            await asyncio.sleep(0.2)  # the load message is served before the turn's request
        return await self._engine.generate(*args, **kwargs)


async def _rollout(tmp_path, **engine_options) -> tuple[dict, list, PushBetweenTurns]:
    config = build_config({"rollout-max-turns": 3, "rollout-batch-size": GROUPS,
                           "n-samples-per-prompt": N, "progress": False,
                           "output-dir": str(tmp_path)})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    model, required = config.policy_config, run_required_traces(config)
    engine = EngineActor("tests.fake_engine:ToolCallingEngine", engine_kwargs(config), required,
                         **engine_options)
    await engine.load_weights(0, WEIGHTS)
    manager = RolloutManager(config.rollout.to_dict(), ["engine_0"], required,
                             model.max_position_embeddings, str(checkpoint), model.vocab_size)
    proxy = PushBetweenTurns(engine)
    manager.proxy = lambda name, timeout=None: proxy
    summary = await manager.generate(0, min_version=0)
    await asyncio.wait_for(proxy.push, 5)  # the push itself never fails
    assert engine.engine.version == 1
    return summary, manager.batches[0], proxy


async def test_a_push_between_turns_waits_and_every_trajectory_keeps_one_version(tmp_path):
    summary, samples, proxy = await _rollout(tmp_path)
    assert len(samples) == GROUPS * N
    # every episode: tool call, observation "= d", answer d <eos> -- two turns on version 0
    for s in samples:
        assert s.policy_version == 0
        assert s.loss_mask.tolist() == [1, 0, 0, 1, 1]
    assert summary["policy_versions"] == [0]
    assert summary["episodes_regenerated"] == 0
    assert summary["tool_calls_mean"] == 1.0
    assert proxy.turns == 2  # one batch, two turns, nothing generated again


async def test_a_lapsed_pin_regenerates_the_whole_batch_at_the_new_version_and_counts_it(tmp_path):
    # the pin lapses while the push waits (the engine idles 0.2 s > 0.05 s between the turns)
    summary, samples, proxy = await _rollout(tmp_path, pin_lease_s=0.05)
    assert len(samples) == GROUPS * N
    for s in samples:
        assert s.policy_version == 1
        assert s.loss_mask.tolist() == [1, 0, 0, 1, 1]
    assert summary["policy_versions"] == [1]
    assert summary["episodes_regenerated"] == GROUPS * N  # the one batch: every episode
    assert proxy.turns == 4  # two turns, then both again
