"""Shared test helper: one training step in-process -- a real EngineActor, RolloutManager and
TrainerActor of a run configuration, joined by fake proxies (tests/fakes.py) instead of
processes, as the task tests and the dynamic-sampling step test drive it."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayrl.rollout.dispatch.engine_actor import EngineActor
from replayrl.rollout.dispatch.manager import RolloutManager
from replayrl.rollout.sample import Sample, samples_from_columns
from replayrl.rollout.tasks import task_class_path
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.launcher import engine_kwargs, resolve_engine, run_required_traces, write_initial_checkpoint
from replayrl.transport.array_bundle import pack_arrays
from tests.fakes import FakeProxy


@dataclass
class StepResult:
    """What :meth:`StepRig.one_step` saw: the manager's generation summary, the trainer's step
    metrics, the samples it trained on, and its weights (name -> array) before and after."""

    summary: dict
    metrics: dict
    samples: list[Sample]
    before: dict
    after: dict


@dataclass
class StepRig:
    """The actors of one in-process step. ``taken``: every column batch the trainer took from
    the manager, in order (see :meth:`connect`)."""

    trainer: Any
    engine: EngineActor
    manager: RolloutManager
    taken: list = field(default_factory=list)

    async def take_batch(self, rollout_id: int):
        """The manager's :meth:`take_batch`, recorded in :attr:`taken`."""
        self.taken.append(await self.manager.take_batch(rollout_id))
        return self.taken[-1]

    def connect(self, manager_methods: dict | None = None, clock_methods: dict | None = None) -> None:
        """Point the trainer's proxies at fakes: the rollout manager answers
        :meth:`take_batch` plus ``manager_methods``; the version clock answers
        ``check_samples`` (the trainer's version), ``set_trainer_version`` (the version given)
        and ``with_timeout`` (itself), plus ``clock_methods`` (which override those)."""

        async def check_samples(ids, versions):
            return self.trainer.version

        async def set_trainer_version(version):
            return version

        clock = FakeProxy(**{"check_samples": check_samples, "set_trainer_version": set_trainer_version,
                             **(clock_methods or {})})
        clock._methods["with_timeout"] = lambda timeout: clock
        proxies = {"rollout_manager": FakeProxy(take_batch=self.take_batch, **(manager_methods or {})),
                   "version_clock": clock}
        self.trainer.proxy = lambda name, timeout=None: proxies[name]

    async def one_step(self) -> StepResult:
        """Rollout 0 at version 0, then the trainer's step 0 on it (:meth:`connect`'s fakes)."""
        summary = await self.manager.generate(0, min_version=0)
        self.connect()
        before = self.trainer.backend.weights()
        metrics = await self.trainer.train(0)
        return StepResult(summary, metrics, samples_from_columns(self.taken[0]), before,
                          self.trainer.backend.weights())


async def step_rig(config, directory: Path, task: str) -> StepRig:
    """The actors of run configuration ``config`` (a ``build_config`` result) for ``--task
    task``: its initial checkpoint written under ``directory / "ckpt"``, the trainer (no
    engines of its own), the engine loaded with the trainer's version-0 weights, and the
    manager generating through that engine (its proxy a fake)."""
    from replayrl.trainer.ranks.trainer_actor import TrainerActor

    checkpoint = write_initial_checkpoint(config, directory / "ckpt")
    model = config.policy_config
    required = run_required_traces(config)
    groups, n = config.rollout.rollout_batch_size, config.rollout.n_samples_per_prompt
    trainer = TrainerActor(str(checkpoint), config.trainer.to_dict(), n_samples_per_prompt=n,
                           engines=[], rollout_batch_size=groups, vocab_tokens=list(VOCABULARY))
    engine = EngineActor(resolve_engine(config), engine_kwargs(config), required)
    await engine.load_weights(0, pack_arrays(trainer.backend.weights()))
    manager = RolloutManager(config.rollout.to_dict(), ["engine_0"], required,
                             model.max_position_embeddings, str(checkpoint), model.vocab_size,
                             task=task_class_path(task))
    manager.proxy = lambda name, timeout=None: FakeProxy(generate=engine.generate)
    return StepRig(trainer, engine, manager)
