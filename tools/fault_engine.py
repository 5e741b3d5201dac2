"""Fault injection for ``replayrl bench faults`` and the fault-tolerance tests: an engine
that sends a real signal to its own process in the middle of a generation.

:class:`SignalledEngine` is the embedded engine plus one fault: at its ``fault_at_call``-th
``generate`` request (counting from 1, in this process) it records the moment in
``fault_marker`` (JSON: ``{"signal", "call", "pid", "time"}``, wall-clock seconds) and sends
``fault_signal`` to itself: ``SIGKILL`` ends the process on the spot, ``SIGSTOP`` freezes it
(its ZeroMQ I/O thread too, so heartbeats go unanswered) until someone kills it. The marker
file also arms the fault once per run: a process started in the engine's place (``--engine-
failure restart``, same constructor arguments) finds it and never signals. The request in
flight is never answered, which is exactly what a crashed or hung engine does to its caller.

:func:`faulty_specs` swaps the fault into one engine of a run's :class:`actors.ActorSpec` list
(``tools.launcher.launch(config, specs=...)``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from actors import ActorSpec
from rollout.engines.embedded import EmbeddedEngine

FAULT_SIGNALS = ("SIGKILL", "SIGSTOP")
"""Signals :class:`SignalledEngine` can send itself."""


class SignalledEngine(EmbeddedEngine):
    """:class:`rollout.engines.embedded.EmbeddedEngine` that signals itself once mid-generation.

    Args:
        model_config, dtype: as :class:`EmbeddedEngine`.
        fault_signal: one of :data:`FAULT_SIGNALS`.
        fault_at_call: the ``generate`` request (1-based, counted in this process) that is
            never answered.
        fault_marker: file written just before the signal; its existence disarms the fault.
    Raises:
        ValueError: an unknown signal or ``fault_at_call < 1``.
    """

    def __init__(self, model_config: Any, dtype: str = "bfloat16", *, fault_signal: str,
                 fault_at_call: int, fault_marker: str) -> None:
        super().__init__(model_config, dtype=dtype)
        if fault_signal not in FAULT_SIGNALS:
            raise ValueError(f"fault_signal must be one of {FAULT_SIGNALS}, got {fault_signal!r}")
        if fault_at_call < 1:
            raise ValueError(f"fault_at_call must be >= 1, got {fault_at_call}")
        self.fault_signal, self.fault_at_call = fault_signal, fault_at_call
        self.fault_marker = Path(fault_marker)
        self.calls = 0

    def _generate(self, prompts, params, **kwargs):
        self.calls += 1
        if self.calls == self.fault_at_call and not self.fault_marker.exists():
            self.fault_marker.write_text(json.dumps({
                "signal": self.fault_signal, "call": self.calls, "pid": os.getpid(),
                "time": time.time()}))
            os.kill(os.getpid(), getattr(signal, self.fault_signal))
            time.sleep(3600)  # SIGSTOP returns here only when continued; answer nothing
        return super()._generate(prompts, params, **kwargs)


def faulty_specs(specs: list[ActorSpec], engine: str, fault_signal: str, fault_at_call: int,
                 fault_marker: str | Path) -> list[ActorSpec]:
    """``specs`` with ``engine``'s engine replaced by a :class:`SignalledEngine` (same model,
    same precision, same traces).

    Raises:
        ValueError: no spec named ``engine``.
    """
    if engine not in [s.name for s in specs]:
        raise ValueError(f"no actor {engine!r} among {[s.name for s in specs]}")
    out = []
    for spec in specs:
        if spec.name == engine:
            kwargs = dict(spec.kwargs)
            kwargs["engine_class"] = f"{__name__}:SignalledEngine"
            kwargs["engine_kwargs"] = {**kwargs["engine_kwargs"], "fault_signal": fault_signal,
                                       "fault_at_call": fault_at_call,
                                       "fault_marker": str(fault_marker)}
            spec = dataclasses.replace(spec, kwargs=kwargs)
        out.append(spec)
    return out
