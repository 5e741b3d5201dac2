"""Fault injection for ``replayrl bench faults`` and the fault-tolerance tests: actors that
send a real signal to their own process at a known call (or, ``HANG``, stop answering it).

Each ``Signalled*`` class is a run's actor (or, for engines, the embedded engine) plus one
fault (:class:`Fault`): at its ``fault_at_call``-th call of one method (counting from 1, in
this process) it records the moment in ``fault_marker`` (JSON: ``{"signal", "call", "pid",
"time"}``, wall-clock seconds) and sends ``fault_signal`` to itself. ``SIGKILL`` ends the process
on the spot; ``SIGSTOP`` freezes it, its ZeroMQ I/O thread too, so heartbeats go unanswered
until the supervisor kills it at the deadline. ``HANG`` sends no signal: the process blocks in
the call and stays connected (its I/O thread answers heartbeats), which is what an engine whose
host is about to be cut off looks like; the multi-host test then cuts the link. The call in
flight is never answered, which is what a crashed or hung process does to its caller. The marker
file also arms the fault once
per run: a process started in the engine's place (``--engine-failure restart``, same
arguments) finds it and never signals.

Which call is hit (the one-step overlapped loop, docs/design/version-clock.md#version-clock):

- an engine's ``generate`` (:class:`SignalledEngine`, inside the engine): call 1 is its part
  of rollout 0, call 2 its part of rollout 1, generated while step 0 trains;
- the trainer's ``train``: call ``k + 1`` is step ``k``;
- the clock's ``set_trainer_version``: call ``k`` records version ``k``, at the end of step
  ``k - 1``;
- the rollout manager's ``generate``: call ``k + 1`` is rollout ``k``.

:func:`faulty_specs` swaps one of them into a run's :class:`replayrl.actors.ActorSpec` list
(``replayrl.tools.run.launcher.launch(config, specs=...)``).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

from replayrl.actors import DRIVER, ActorSpec
from replayrl.actors.version_clock import VersionClock
from replayrl.rollout.dispatch.manager import RolloutManager
from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.trainer.ranks.trainer_actor import TrainerActor
from replayrl.transport import strict_json

FAULT_SIGNALS = ("SIGKILL", "SIGSTOP", "HANG")
"""Signals a fault can send (``HANG``: none, the call just never returns)."""


class Fault:
    """One self-signal at the ``at_call``-th :meth:`hit` of this process, once per run.

    Args:
        signal: one of :data:`FAULT_SIGNALS`.
        at_call: the 1-based call that is never answered.
        marker: file written just before the signal; its existence disarms the fault.
    Raises:
        ValueError: an unknown signal or ``at_call < 1``.
    """

    def __init__(self, signal: str, at_call: int, marker: str) -> None:
        if signal not in FAULT_SIGNALS:
            raise ValueError(f"fault_signal must be one of {FAULT_SIGNALS}, got {signal!r}")
        if at_call < 1:
            raise ValueError(f"fault_at_call must be >= 1, got {at_call}")
        self.signal, self.at_call, self.marker = signal, at_call, Path(marker)
        self.calls = 0

    def hit(self) -> None:
        """Count one call; at ``at_call`` (unless the marker exists) signal this process."""
        self.calls += 1
        if self.calls == self.at_call and not self.marker.exists():
            self.marker.write_text(strict_json.dumps({"signal": self.signal, "call": self.calls,
                                                      "pid": os.getpid(), "time": time.time()}))
            if self.signal != "HANG":
                os.kill(os.getpid(), getattr(signal, self.signal))
            time.sleep(3600)  # a stopped process resumes here only if continued: still silent


class SignalledEngine(EmbeddedEngine):
    """:class:`replayrl.rollout.engines.embedded.EmbeddedEngine` whose ``generate`` carries a
    :class:`Fault` (``fault_signal``, ``fault_at_call``, ``fault_marker``)."""

    def __init__(self, model_config: Any, dtype: str = "bfloat16", *, fault_signal: str,
                 fault_at_call: int, fault_marker: str, **engine_kwargs: Any) -> None:
        super().__init__(model_config, dtype=dtype, **engine_kwargs)  # the launcher's device too
        self.fault = Fault(fault_signal, fault_at_call, fault_marker)

    def _generate(self, prompts, params, **kwargs):
        self.fault.hit()
        return super()._generate(prompts, params, **kwargs)


class _CarriesFault:
    """The ``fault_signal`` / ``fault_at_call`` / ``fault_marker`` keywords of an actor spec made
    into ``self.fault`` (a :class:`Fault`); every other argument goes to the actor class after
    it in the MRO."""

    def __init__(self, *args: Any, fault_signal: str, fault_at_call: int, fault_marker: str,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault = Fault(fault_signal, fault_at_call, fault_marker)


class SignalledTrainer(_CarriesFault, TrainerActor):
    """:class:`replayrl.trainer.ranks.trainer_actor.TrainerActor` whose ``train`` carries a :class:`Fault`."""

    async def train(self, rollout_id: int) -> dict:
        """As :meth:`TrainerActor.train`, after the fault's call count."""
        self.fault.hit()
        return await super().train(rollout_id)


class SignalledClock(_CarriesFault, VersionClock):
    """:class:`replayrl.actors.version_clock.VersionClock` whose ``set_trainer_version`` carries a
    :class:`Fault`."""

    async def set_trainer_version(self, version: int) -> int:
        """As :meth:`VersionClock.set_trainer_version`, after the fault's call count."""
        self.fault.hit()
        return await super().set_trainer_version(version)


class SignalledManager(_CarriesFault, RolloutManager):
    """:class:`replayrl.rollout.dispatch.manager.RolloutManager` whose ``generate`` carries a :class:`Fault`."""

    async def generate(self, rollout_id: int, min_version: int | None = None) -> dict:
        """As :meth:`RolloutManager.generate`, after the fault's call count."""
        self.fault.hit()
        return await super().generate(rollout_id, min_version)


_ACTORS = {"trainer": "SignalledTrainer", "version_clock": "SignalledClock",
           "rollout_manager": "SignalledManager"}


def faulty_specs(specs: list[ActorSpec], actor: str, fault_signal: str, fault_at_call: int,
                 fault_marker: str | Path) -> list[ActorSpec]:
    """``specs`` with ``actor`` carrying the fault: an engine actor (``engine_i``) gets a
    :class:`SignalledEngine` (same model, precision and traces); ``trainer``,
    ``version_clock`` and ``rollout_manager`` their ``Signalled*`` class (same arguments), in a
    process of their own: the launcher serves those two itself (``process`` =
    :data:`replayrl.actors.DRIVER`), where a signal would hit the launcher, not the actor.

    Raises:
        ValueError: no spec named ``actor``, or an actor without a fault class.
    """
    if actor not in [s.name for s in specs]:
        raise ValueError(f"no actor {actor!r} among {[s.name for s in specs]}")
    fault = {"fault_signal": fault_signal, "fault_at_call": fault_at_call,
             "fault_marker": str(fault_marker)}
    out = []
    for spec in specs:
        if spec.name == actor:
            kwargs = dict(spec.kwargs)
            if "engine_class" in kwargs:
                kwargs["engine_class"] = f"{__name__}:SignalledEngine"
                kwargs["engine_kwargs"] = {**kwargs["engine_kwargs"], **fault}
                spec = dataclasses.replace(spec, kwargs=kwargs)
            elif actor in _ACTORS:
                spec = dataclasses.replace(spec, cls=f"{__name__}:{_ACTORS[actor]}",
                                           kwargs={**kwargs, **fault},
                                           process="" if spec.process == DRIVER else spec.process)
            else:
                raise ValueError(f"no fault class for actor {actor!r}")
        out.append(spec)
    return out
