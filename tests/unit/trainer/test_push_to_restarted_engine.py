"""A restarted engine's weights (``TrainerActor.push_weights_to``) while the last push is still in flight:
that push's load, sent to the engine's endpoint before its loss was seen, is answered by the new
process; its record must reach the clock before the newer version's (a chaos soak once ended with
the clock's VersionRegression here)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from replayrl.actors.version_clock import VersionRules
from replayrl.rollout.weight_sync.base import Delivery, Packed
from replayrl.trainer.ranks.trainer_actor import TrainerActor


class _Sync:
    """Delivers at once: every load is answered as soon as it is sent."""

    collective = False

    def pack(self, tensors, *, version, home=None):
        return Packed(payload={}, nbytes=0)

    async def deliver(self, packed, version, engines, proxy, lost=()):
        loads = {}
        for e in engines:
            loads[e] = asyncio.get_running_loop().create_future()
            loads[e].set_result(0.0)
        return Delivery(loads=loads)


def _trainer(records: list, rules: VersionRules) -> TrainerActor:
    trainer = object.__new__(TrainerActor)  # the push logic only, no process, no backend

    class Clock:
        async def record_engine_load(self, engine, version):
            records.append((engine, version))
            rules.record_engine_load(engine, version)  # raises VersionRegression going backwards

    async def reachable(timeout):
        return None

    async def push_tensors(full=True):
        return {}

    trainer.engines, trainer.clock_name, trainer.engine_failure = ["engine_0", "engine_1"], "clock", "restart"
    trainer.version, trainer._lost, trainer._sync, trainer.backend = 5, {"engine_1"}, _Sync(), None
    trainer.config = SimpleNamespace(rpc_timeout_s=5.0)
    trainer.proxy = lambda name, timeout: Clock()
    trainer.ref = lambda name: SimpleNamespace(reachable=reachable)
    trainer._push_tensors = push_tensors
    return trainer


def test_the_push_in_flight_is_recorded_before_the_restarted_engines_newer_version():
    records, rules = [], VersionRules(max_staleness=1)

    async def run():
        trainer = _trainer(records, rules)
        loop = asyncio.get_running_loop()
        engine_0, engine_1 = loop.create_future(), loop.create_future()
        engine_0.set_result(0.0)
        loop.call_later(0.05, engine_1.set_result, 0.0)  # the new process answers version 4 late
        trainer._push = asyncio.ensure_future(
            trainer._complete(Packed(payload={}, nbytes=0),
                              Delivery(loads={"engine_0": engine_0, "engine_1": engine_1}), 4))
        result = await trainer.push_weights_to("engine_1")
        left = [trainer._push] if trainer._push is not None else []  # the old push, if not done
        errors = [e for e in await asyncio.gather(*left, return_exceptions=True) if e is not None]
        return result, errors, "engine_1" in trainer._lost

    result, errors, lost = asyncio.run(run())
    assert records == [("engine_0", 4), ("engine_1", 4), ("engine_1", 5)]
    assert errors == [] and rules.engine_versions == {"engine_0": 4, "engine_1": 5}
    assert result["version"] == 5 and not lost
