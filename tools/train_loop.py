"""The one-step-asynchronous training loop, in a page (the shape of slime's train_async.py).

Generation of rollout k+1 runs on the engines while the trainer trains on rollout k; the new
weights are pushed only after that generation finished, so every sample enters its step exactly
one version stale (``t - v = 1``) except the very first batch (``t - v = 0``). The VersionClock
checks that window on every step.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from actors import Directory
from tools.config import RunConfig


async def train_loop(directory: Directory, config: RunConfig,
                     on_step: Callable[[dict], None]) -> None:
    """Run ``config.num_steps`` optimizer steps; call ``on_step(metrics)`` after each."""
    manager, trainer = directory.ref("rollout_manager"), directory.ref("trainer")
    push = await trainer.call("push_weights")  # engines serve nothing before this (version 0)
    generated = await manager.call("generate", 0)
    for step in range(config.num_steps):
        step_start = time.perf_counter()
        next_rollout = None
        if step + 1 < config.num_steps:  # overlaps with training below
            next_rollout = asyncio.ensure_future(manager.call("generate", step + 1))
        try:
            trained = await trainer.call("train", step)
        except BaseException:
            if next_rollout is not None:
                next_rollout.cancel()
            raise
        summary = generated
        if next_rollout is not None:
            generated = await next_rollout
            push = await trainer.call("push_weights")
        on_step({"step": step, **{k: v for k, v in summary.items() if k != "policy_versions"},
                 **trained, "weight_push_seconds": push["seconds"], "weight_push_bytes": push["bytes"],
                 "step_seconds": time.perf_counter() - step_start})
