"""What a ``--colocate`` run does when it loses its colocated process (docs/fault-tolerance.md).

Under ``--colocate`` the version clock, the rollout manager, ``engine_0`` and the trainer share
one process (``replayrl.tools.run.launcher.COLOCATED``). ``engine_0`` failing with its process
(killed, out of memory, a crash in native code) is the trainer's loss too: there is no trainer
left to restore weights from and no manager left to regenerate groups, so ``--engine-failure``
cannot keep the run going (it applies to engines in processes of their own, ``--num-engines``
above 1). The run ends as any other lost actor ends it: every other process stopped, exit 1,
and the last complete ``--save-interval`` checkpoint on disk. :func:`explain_colocated_loss`
makes the error say so and name that checkpoint, the one to rerun the command with ``--load``.
"""
from __future__ import annotations

from pathlib import Path

from replayrl.actors import ActorDied
from replayrl.tools.run.checkpoint_dirs import latest_checkpoint
from replayrl.tools.run.config import RunConfig


def explain_colocated_loss(config: RunConfig, exc: ActorDied,
                           colocated: tuple[str, ...]) -> ActorDied:
    """``exc`` with a ``note`` (:class:`replayrl.actors.ActorDied`) saying why the run cannot go
    on and naming the last complete checkpoint under ``config.save_dir`` (with
    ``--save-interval``) to rerun the command with ``--load``, when the lost actor is one of
    ``colocated`` (``replayrl.tools.run.launcher.colocated_actors(config)``: empty without
    ``--colocate``); any other loss, or one already noted, is returned as it is."""
    if exc.actor not in colocated or exc.note:
        return exc
    checkpoint = latest_checkpoint(Path(config.save_dir)) if config.save_interval else None
    resume = (f"the last complete checkpoint is {checkpoint}: rerun the same command with "
              f"--load {checkpoint}" if checkpoint is not None else
              "no checkpoint was complete (--save-interval): a rerun starts over")
    note = ("under --colocate engine_0 shares this process with the trainer, the version clock "
            "and the rollout manager, so --engine-failure cannot keep the run going (it applies "
            f"to engines of their own, --num-engines above 1); {resume}")
    return ActorDied(exc.actor, exc.exitcode, exc.traceback_text, exc.members, note)
