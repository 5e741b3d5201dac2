"""Small actors used by the actor-runtime tests (importable by spawned processes)."""
from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

from replayrl.actors import Actor, concurrent


class EchoActor(Actor):
    """Echoes, sums arrays, raises on demand, sleeps, and remembers call order."""

    def __init__(self, tag: str = "echo") -> None:
        self.tag = tag
        self.seen: list[int] = []

    async def echo(self, value):
        return value

    async def total(self, array: np.ndarray) -> float:
        return float(np.asarray(array, dtype=np.float64).sum())

    async def fail(self, message: str) -> None:
        """Raise ``ValueError(message)``.

        (A docstring for the interface tests.)"""
        raise ValueError(message)

    async def sleep(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "slept"

    @concurrent
    async def sleep_concurrently(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "slept"

    async def record(self, i: int) -> None:
        self.seen.append(i)

    async def recorded(self) -> list[int]:
        return self.seen

    async def pid(self) -> int:
        return os.getpid()

    async def torch_imported(self) -> bool:
        return "torch" in sys.modules

    async def type_name(self, value) -> str:
        return type(value).__name__

    async def crash(self) -> None:
        # an actor whose process dies (not a method error): the supervisor must notice
        os._exit(3)


class CrashOnStart(Actor):
    """An actor whose constructor raises: the run must fail fast with this traceback."""

    def __init__(self) -> None:
        raise RuntimeError("boom in constructor of CrashOnStart")


class HangOnStart(Actor):
    """An actor whose constructor never returns (a start stuck in an import or a lock): the
    supervisor must name it, print where it is stuck and stop it."""

    def __init__(self) -> None:
        import time
        while True:
            time.sleep(0.1)  # stuck_in_constructor: the frame its stack dump must show



class AffinityProbe(Actor):
    """Reports the CPUs its process may run on (``--cpu-affinity`` tests)."""

    async def cpus(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))


class EnvProbe(Actor):
    """Reports its process's environment and whether torch is loaded there (an
    ``ActorSpec.env`` must be in place before torch loads libgomp, which reads
    ``GOMP_SPINCOUNT`` once)."""

    async def env(self, name: str) -> str | None:
        return os.environ.get(name)

    async def torch_loaded(self) -> bool:
        return "torch" in sys.modules
