"""``replayrl train`` killed while its K-th checkpoint is written, for ``replayrl bench resume``.

``python -m replayrl.tools.bench.kill_in_save K TRAIN_FLAGS...`` runs ``replayrl train
TRAIN_FLAGS`` unchanged but for one thing: when the rollout manager has written its part of the
K-th checkpoint (the trainer's files are written before it), the whole process group gets
SIGKILL. The checkpoint is then ``step-N.partial`` with the model, the trainer state and the
prefetched rollout but no ``run_state.json`` and no rename: the moment a kill during a checkpoint
write is most likely to leave something that looks loadable. Run it as the leader of a process
group of its own (``start_new_session``): the launcher and every actor process die together, as
a node's OOM killer or a preempted job's SIGKILL would end them.
"""
from __future__ import annotations

import itertools
import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    """Patch the rollout manager's ``state`` (served in this, the launcher's, process) and run
    ``replayrl train`` with the remaining arguments.

    Raises:
        ValueError: the first argument is not an int >= 1.
    """
    argv = sys.argv[1:] if argv is None else argv
    at = int(argv[0])
    if at < 1:
        raise ValueError(f"the checkpoint to kill in must be >= 1, got {at}")
    from replayrl.rollout.dispatch.manager import RolloutManager
    from replayrl.tools.cli import main as cli_main

    original = RolloutManager.state
    saves = itertools.count(1)

    async def state(self, next_rollout_id=None, directory=None):
        out = await original(self, next_rollout_id, directory)
        if directory is not None and next(saves) == at:  # a checkpoint's, not a console's call
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return out

    RolloutManager.state = state
    return cli_main(["train", *argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
