"""The engine actor: hosts any rollout engine (:mod:`rollout.engines`) in its own process.

It is built from the engine's ``"module:Class"`` path (resolved from the registry by the
launcher) and the engine's constructor kwargs, and serves two requests: ``load_weights`` (a
weight push of one policy version) and ``generate`` (one turn per prompt). Every reply to
``generate`` carries the version the engine served, which becomes each sample's
``policy_version``. Readiness ("no request before the first weight load") is the engine
interface's rule (:meth:`rollout.engines.base.Engine.generate`), so it holds for every engine.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np
import torch

from actors import Actor
from rollout.engines import check_capture, load_engine_class
from rollout.engines.base import generations_to_columns
from rollout.sampler import SamplingParams
from transport.array_bundle import unpack_arrays


class EngineActor(Actor):
    """Actor around one :class:`rollout.engines.base.Engine`.

    Args:
        engine_class: ``"module:Class"`` of an ``Engine`` subclass (``rollout.engines.ENGINES``).
        engine_kwargs: the engine's constructor keyword arguments (plain data).
        traces: the trace fields every ``generate`` captures: the run's required traces
            (``rollout.sample.required_traces``), no more, no less.
        torch_threads: intra-op threads for this process (the trainer runs beside it).

    Raises:
        rollout.engines.EngineError: ``engine_class`` is not an importable ``Engine`` subclass.
        rollout.engines.EngineCaptureError: the engine cannot capture one of ``traces``.
    """

    def __init__(self, engine_class: str, engine_kwargs: Mapping[str, Any], traces: list[str],
                 torch_threads: int = 1) -> None:
        torch.set_num_threads(torch_threads)
        cls = load_engine_class(engine_class)
        self.traces = tuple(sorted(check_capture(cls, traces)))  # fail at start, not mid-run
        self.engine = cls(**dict(engine_kwargs))

    async def load_weights(self, version: int, weights: Mapping[str, Any]) -> float:
        """Load a full weight set of policy ``version``; returns seconds spent.

        Args:
            weights: the arrays as one bundle (``transport.array_bundle.pack_arrays``): a
                hundred small frames cost far more to send than one.
        Raises:
            transport.DecodeError: a malformed bundle (nothing loaded).
            rollout.engines.EngineInputError: ``version`` is below the version already loaded.
            Whatever the engine's weight loading raises (previous weights stay).
        """
        start = time.perf_counter()
        self.engine.load_weights(unpack_arrays(weights), version=version)
        return time.perf_counter() - start

    async def generate(self, prompts: list[np.ndarray], sampling: dict, *, max_new_tokens: int,
                       eos_token_id: int, seed: int) -> dict:
        """Generate one turn per prompt, capturing this actor's ``traces``.

        Args:
            prompts: ``B >= 1`` int token-id arrays (each the whole context of its turn).
            sampling: :class:`rollout.sampler.SamplingParams` fields.
            max_new_tokens, eos_token_id, seed: as :meth:`rollout.engines.base.Engine.generate`.

        Returns:
            ``{"version": int, "generations": rollout.engines.base.generations_to_columns(...)}``.

        Raises:
            rollout.engines.EngineNotReady: no weights loaded yet in this run.
            rollout.engines.EngineError (and subclasses): the engine rejected the request.
        """
        gens = self.engine.generate([np.asarray(p).tolist() for p in prompts],
                                    SamplingParams(**sampling), max_new_tokens=max_new_tokens,
                                    eos_token_id=eos_token_id, seed=seed, traces=self.traces)
        return {"version": self.engine.version, "generations": generations_to_columns(gens)}
