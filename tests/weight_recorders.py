"""Actors that record the weights of every push, for tests that compare what engines loaded
with what the trainer pushed, tensor by tensor.

Each writes ``<$REPLAYRL_TEST_WEIGHTS>/<actor>-v<version>.npz`` (float32 arrays under HF names):
the trainer the tensors it pushes (``TrainerBackend.push_tensors``) as it starts each push, an
engine its model's state once it loaded a push. Swap them into a run's actor specs with
:func:`recording_specs`.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from replayrl.actors import concurrent
from replayrl.rollout.dispatch.engine_actor import EngineActor
from replayrl.trainer.ranks.trainer_actor import TrainerActor

WEIGHTS_ENV = "REPLAYRL_TEST_WEIGHTS"


def _save(name: str, version: int, tensors: dict) -> None:
    directory = Path(os.environ[WEIGHTS_ENV])
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / f"{name}-v{version}.npz",
             **{k: t.detach().float().cpu().numpy() for k, t in tensors.items()})


class RecordingEngineActor(EngineActor):
    """The engine actor, recording its model's weights after each load."""

    @concurrent
    async def load_weights(self, version: int, weights) -> float:
        seconds = await super().load_weights(version, weights)
        _save(self.name, version, self.engine.model.state_dict())
        return seconds


class RecordingTrainer(TrainerActor):
    """The trainer actor, recording the tensors of each push before it is sent."""

    async def push_weights(self, wait: bool = True) -> dict:
        _save(self.name, self.version, self.backend.push_tensors())
        return await super().push_weights(wait)


def recording_specs(specs: list, directory: Path) -> list:
    """``specs`` with the engines and the trainer replaced by the recording actors, which write
    into ``directory``."""
    classes = {"replayrl.rollout.dispatch.engine_actor:EngineActor": "tests.weight_recorders:RecordingEngineActor",
               "replayrl.trainer.ranks.trainer_actor:TrainerActor": "tests.weight_recorders:RecordingTrainer"}
    return [dataclasses.replace(s, cls=classes[s.cls], env={**s.env, WEIGHTS_ENV: str(directory)})
            if s.cls in classes else s for s in specs]


def recorded(directory: Path) -> dict[tuple[str, int], dict[str, np.ndarray]]:
    """``(actor, version) -> arrays`` of every file in ``directory``."""
    out = {}
    for path in sorted(Path(directory).glob("*-v*.npz")):
        name, _, version = path.stem.rpartition("-v")
        with np.load(path) as data:
            out[(name, int(version))] = {k: data[k] for k in data.files}
    return out
