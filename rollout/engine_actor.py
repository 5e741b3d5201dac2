"""The engine actor: serves generation requests from the embedded bf16 engine.

It refuses to generate before its first weight load of the run (DESIGN.md: an engine serves no
request before its first weight load) and stamps every reply with the weight version it served,
which becomes each sample's ``policy_version``.
"""
from __future__ import annotations

import time
from dataclasses import fields
from typing import Mapping

import numpy as np
import torch

from actors import Actor
from rollout.model.config import ModelConfig
from rollout.sampler import SamplingParams


class EngineActor(Actor):
    """Actor around :class:`rollout.engine.EmbeddedEngine`.

    Args:
        model_config: :class:`ModelConfig` fields as a dict (HF names).
        dtype: ``"bfloat16"`` (default: real train-inference mismatch) or ``"float32"``.
        torch_threads: intra-op threads for this process (the trainer runs beside it).
    """

    def __init__(self, model_config: dict, dtype: str = "bfloat16", torch_threads: int = 1) -> None:
        from rollout.engine import EmbeddedEngine  # heavy import stays in the actor process

        torch.set_num_threads(torch_threads)
        self.engine = EmbeddedEngine(ModelConfig(**model_config), dtype=getattr(torch, dtype))
        self.version: int | None = None

    async def load_weights(self, version: int, arrays: Mapping[str, np.ndarray]) -> float:
        """Load a full weight set of policy ``version``; returns seconds spent.

        Raises:
            ValueError: ``version`` is lower than the version already loaded.
        """
        if self.version is not None and version < self.version:
            raise ValueError(f"engine {self.name}: weight version would move backwards "
                             f"{self.version} -> {version}")
        start = time.perf_counter()
        self.engine.load_weights(arrays)
        self.version = version
        return time.perf_counter() - start

    async def generate(self, prompts: list[np.ndarray], sampling: dict, *, max_new_tokens: int,
                       eos_token_id: int, seed: int) -> dict:
        """Generate one trajectory per prompt.

        Returns:
            ``{"version": int, "generations": [Generation fields as dicts]}``.
        Raises:
            rollout.engine.EngineNotReady: no weights loaded yet in this run.
        """
        gens = self.engine.generate([np.asarray(p).tolist() for p in prompts],
                                    SamplingParams(**sampling), max_new_tokens=max_new_tokens,
                                    eos_token_id=eos_token_id, seed=seed)
        return {"version": self.version,
                "generations": [{f.name: getattr(g, f.name) for f in fields(g)} for g in gens]}

    async def generate_multi_turn(self, prompts: list[np.ndarray], sampling: dict, *, max_turns: int,
                                  max_new_tokens: int, eos_token_id: int, seed: int) -> dict:
        """Multi-turn trajectories with the tool environment (:mod:`rollout.multi_turn`).

        All turns of a trajectory run inside this one call, so they share one weight version.

        Returns:
            ``{"version": int, "generations": [dicts of Sample fields + finish_reason]}``.
        """
        from rollout.multi_turn import generate_multi_turn

        outs = generate_multi_turn(self.engine, [np.asarray(p).tolist() for p in prompts],
                                   SamplingParams(**sampling), max_turns=max_turns,
                                   max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, seed=seed)
        return {"version": self.version, "generations": outs}
