"""The training loops, in a page: one-step asynchronous (the shape of slime's train_async.py)
and, with ``--max-staleness 0``, synchronous on-policy (slime's train.py).

Generation of rollout k+1 runs on the engines while the trainer trains on rollout k; the new
weights are pushed only after that generation finished, so every sample enters its step exactly
one version stale (``t - v = 1``) except the first batch of a run or of a resume (``t - v = 0``).
The VersionClock checks that window on every step.

A step the trainer skips (nothing to train, ``skipped: 1`` in its metrics,
docs/design/rejection-sampling.md#rejection-sampling) moved no weight and no version, so nothing is
pushed after it (:data:`NO_PUSH`): the engines keep the weights they have, the next batch was
generated at the trainer's unchanged version (staleness 0, inside the window) and the row is still
recorded.

With ``--max-staleness 0`` nothing overlaps: each step generates rollout k from the weights of
version k, trains on it and pushes version k + 1 (waiting for the engines' load) before rollout
k + 1 is generated (:func:`sync_step`), so every sample enters its step at staleness exactly 0
and the clock's window ``0 <= t - v <= 0`` admits nothing else (docs/design/version-clock.md#version-clock).

Evaluation (``--eval-interval``) runs after a step's weight push, on the engines, while no
rollout is generating; its figures join that step's row (``eval/NAME/...``).

Checkpoints (``--save-interval``) are taken after a step's weight push. They hold the trainer
(model, optimizer, version, RNG), the clock and the data source as it was *before* the
prefetched rollout was drawn, so a resumed run draws that batch again from the restored policy.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from replayrl.actors import Directory
from replayrl.tools.run.config import RunConfig
from replayrl.transport import strict_json

NO_PUSH = {"version": None, "seconds": 0.0, "bytes": 0}
"""The ``push`` figures of a step after which nothing was pushed (a skipped step)."""


async def push_after(trained: dict, trainer, wait: bool = True) -> dict:
    """Push the weights after a trained step; after a skipped one the engines keep theirs.

    Args:
        trained: the trainer's ``train`` result.
        trainer: a proxy to the TrainerActor.
        wait: as ``TrainerActor.push_weights``: with ``False`` the push is only sent, and the
            next generation must ask for its version (``min_version``).
    Returns:
        the ``push_weights`` result, or a copy of :data:`NO_PUSH` when ``trained["skipped"]``.
    Raises:
        replayrl.actors.RemoteError: the push (or, with ``wait=False``, the previous one) failed.
    """
    if trained.get("skipped"):
        return dict(NO_PUSH)
    return await trainer.push_weights(wait)


def _served(push: dict, served: int) -> int:
    """The version the engines serve after ``push`` (unchanged after a skipped step's NO_PUSH)."""
    return push["version"] if push["version"] is not None else served


def step_metrics(step: int, summary: dict, trained: dict, push: dict, step_seconds: float) -> dict:
    """The metrics row of one step, as ``metrics.jsonl`` records it (also ``ReplSession.step``).

    Args:
        step: the rollout id / step index.
        summary: the RolloutManager's ``generate`` result; its ``policy_versions`` list is
            dropped (the row keeps the scalar staleness figures).
        trained: the trainer's ``train`` result (``trainer_version``, ``loss_tokens``, ...).
        push: the trainer's ``push_weights`` result, ``{"seconds": float, "bytes": int, ...}``.
        step_seconds: wall seconds of the whole step.
    Returns:
        ``{"step", **summary (without policy_versions), **trained, "weight_push_seconds",
        "weight_push_bytes", "step_seconds"}``; later keys win on a clash.
    Raises:
        KeyError: ``push`` lacks ``seconds`` or ``bytes``.
    """
    return {"step": step, **{k: v for k, v in summary.items() if k != "policy_versions"},
            **trained, "weight_push_seconds": push["seconds"], "weight_push_bytes": push["bytes"],
            "step_seconds": step_seconds}


async def sync_step(manager, trainer, step: int) -> tuple[dict, dict, dict, dict]:
    """One synchronous on-policy step: generate rollout ``step`` with the engines' current
    weights, train on it, push the new weights (nothing after a skipped step).

    Args:
        manager, trainer: proxies to the RolloutManager and the TrainerActor.
    Returns:
        ``(summary, trained, push, waits)``: the ``generate``, ``train`` and push results, and
        the idle times of this shape: ``wait_for_rollout_seconds`` (the trainer waited for the
        whole generation) and ``wait_for_trainer_seconds`` (the engines waited for training and
        the push); seconds.
    Raises:
        replayrl.actors.RemoteError: generation, training or the push failed.
    """
    start = time.perf_counter()
    summary = await manager.generate(step)
    generated = time.perf_counter()
    trained = await trainer.train(step)
    push = await push_after(trained, trainer)
    waits = {"wait_for_rollout_seconds": generated - start,
             "wait_for_trainer_seconds": time.perf_counter() - generated}
    return summary, trained, push, waits


async def save_checkpoint(directory: Directory, path: Path, next_step: int,
                          config: RunConfig) -> None:
    """Write the run's state after ``next_step - 1`` steps to ``path``.

    Everything is written into ``<path>.partial`` first and renamed to ``path`` once complete,
    so an actor that dies while saving leaves the earlier checkpoints intact and no directory
    named like a checkpoint that is not one.
    """
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a run that died while saving
    partial.mkdir(parents=True)
    await directory.proxy("trainer").save_checkpoint(str(partial))
    state = {"next_step": next_step, "data_settings": config.data_settings(),
             "clock": await directory.proxy("version_clock").state(),
             "manager": await directory.proxy("rollout_manager").state(next_step)}
    (partial / "run_state.json").write_text(strict_json.dumps(state, indent=1))
    if path.exists():  # a rerun into the same --save directory replaces its checkpoint
        shutil.rmtree(path)
    os.replace(partial, path)


def checkpoint_next_step(path: Path) -> int:
    """The step a run resumed from checkpoint ``path`` continues from (its ``run_state.json``).

    Raises:
        FileNotFoundError: ``path`` is not a replayrl checkpoint.
    """
    return int(strict_json.loads((path / "run_state.json").read_text())["next_step"])


async def load_checkpoint(directory: Directory, path: Path) -> int:
    """Restore every actor from ``path``; returns the step to continue from.

    Raises:
        FileNotFoundError: ``path`` is not a replayrl checkpoint.
    """
    state = strict_json.loads((path / "run_state.json").read_text())
    await directory.proxy("trainer").load_checkpoint(str(path))
    await directory.proxy("version_clock").load_state(state["clock"])
    await directory.proxy("rollout_manager").load_state(state["manager"])
    return int(state["next_step"])


async def save_outputs(directory: Directory, trainer, config: RunConfig, step: int) -> None:
    """After step ``step``: the ``--save-interval`` checkpoint and the ``--save-hf`` directory
    (every ``--save-interval`` steps and after the last step)."""
    interval = config.save_interval and (step + 1) % config.save_interval == 0
    if interval:
        await save_checkpoint(directory, Path(config.save_dir) / f"step-{step + 1}", step + 1,
                              config)
    if config.save_hf and (interval or step + 1 == config.num_steps):
        await trainer.save_hf(str(Path(config.save_hf) / f"step-{step + 1}"))


async def train_loop(directory: Directory, config: RunConfig,
                     on_step: Callable[[dict], None]) -> None:
    """Run steps up to ``config.num_steps``; call ``on_step(metrics)`` after each, with the
    row :func:`step_metrics` builds plus the overlap's waits: ``wait_for_rollout_seconds``
    (training finished, the next rollout had not) and ``wait_for_trainer_seconds`` (the next
    rollout was ready while the trainer still trained; the engines idled). With
    ``config.max_staleness == 0`` the steps are :func:`sync_step` in sequence.

    ``on_step`` runs in a worker thread, one call at a time, awaited before the next step: the
    launchers serve the version clock and the rollout manager on this event loop
    (:class:`replayrl.actors.DriverActors`), and a metrics hook, a W&B upload or a TensorBoard
    flush must not stop them answering. What it raises ends the loop."""
    manager, trainer = directory.proxy("rollout_manager"), directory.proxy("trainer")
    first = await load_checkpoint(directory, Path(config.load)) if config.load else 0
    push = await trainer.push_weights()  # engines serve nothing before this
    served = push["version"]  # the version the next rollout is generated at
    if first >= config.num_steps:
        return
    if config.max_staleness == 0:
        for step in range(first, config.num_steps):
            step_start = time.perf_counter()
            summary, trained, push, waits = await sync_step(manager, trainer, step)
            served = _served(push, served)
            evaluation = {}
            if config.eval_interval and ((step + 1) % config.eval_interval == 0
                                         or step + 1 == config.num_steps):
                evaluation = await manager.evaluate(step + 1, min_version=served)
            await save_outputs(directory, trainer, config, step)
            await asyncio.to_thread(on_step, {
                **step_metrics(step, summary, trained, push, time.perf_counter() - step_start),
                **waits, **evaluation})
        return
    generated = await manager.generate(first)
    for step in range(first, config.num_steps):
        step_start = time.perf_counter()
        next_rollout, generated_at = None, [step_start]
        if step + 1 < config.num_steps:  # overlaps with training below
            # the last push may still be on its way: the engines wait for it, not this loop
            next_rollout = asyncio.ensure_future(manager.generate(step + 1, min_version=served))
            next_rollout.add_done_callback(lambda _, at=generated_at: at.append(time.perf_counter()))
        try:
            trained = await trainer.train(step)
        except BaseException:
            if next_rollout is not None:
                next_rollout.cancel()
            raise
        trained_at = time.perf_counter()
        summary = generated
        saving = config.save_interval and (step + 1) % config.save_interval == 0
        if next_rollout is not None:
            generated = await next_rollout
            # sent, not awaited: the engines load while the next step trains (a checkpoint
            # waits for the load, so the clock it saves has recorded it)
            push = await push_after(trained, trainer, wait=bool(saving))
            served = _served(push, served)
        # the two sides of the overlap: who waited for whom, from the driver's clock
        waits = {"wait_for_rollout_seconds": max(0.0, generated_at[-1] - trained_at),
                 "wait_for_trainer_seconds": max(0.0, trained_at - generated_at[-1])
                 if next_rollout is not None else 0.0}
        evaluation = {}
        if config.eval_interval and ((step + 1) % config.eval_interval == 0
                                     or step + 1 == config.num_steps):
            if next_rollout is None:  # the last step: its weights are not pushed otherwise
                push = await push_after(trained, trainer)
                served = _served(push, served)
            evaluation = await manager.evaluate(step + 1, min_version=served)
        await save_outputs(directory, trainer, config, step)
        await asyncio.to_thread(on_step, {
            **step_metrics(step, summary, trained, push, time.perf_counter() - step_start),
            **waits, **evaluation})
