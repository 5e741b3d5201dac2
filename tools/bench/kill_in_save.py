"""``replayrl train`` killed while its K-th checkpoint is written, for ``replayrl bench resume``.

``python -m replayrl.tools.bench.kill_in_save K TRAIN_FLAGS...`` runs what ``replayrl train
TRAIN_FLAGS`` runs (the same flags, config and launcher) but for one thing: when the rollout
manager has written its part of the K-th checkpoint (the trainer's files are written before
it), the whole process group gets SIGKILL. The checkpoint is then ``step-N.partial`` with the
model, the trainer state and the prefetched rollout but no ``run_state.json`` and no rename:
the moment a kill during a checkpoint write is most likely to leave something that looks
loadable. Run it as the leader of a process group of its own (``start_new_session``): the
launcher and every actor process die together, as a node's OOM killer or a preempted job's
SIGKILL would end them.
"""
from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    """Patch the rollout manager's ``state`` (served in this, the launcher's, process) and run
    the training of ``replayrl train`` with the remaining arguments.

    Raises:
        ValueError: the first argument is not an int >= 1.
        replayrl.tools.errors.ConfigError: the flags, as ``replayrl train`` refuses them.
    """
    argv = sys.argv[1:] if argv is None else argv
    at = int(argv[0])
    if at < 1:
        raise ValueError(f"the checkpoint to kill in must be >= 1, got {at}")
    from replayrl.actors import run_event_loop
    from replayrl.rollout.dispatch.manager import RolloutManager
    from replayrl.tools.run.flags import add_run_flags
    from replayrl.tools.run.from_flags import config_from_args
    from replayrl.tools.run.launcher import launch

    parser = argparse.ArgumentParser(prog="replayrl train")
    add_run_flags(parser)
    config = config_from_args(parser.parse_args(argv[1:]))
    original = RolloutManager.state
    saves = itertools.count(1)

    async def state(self, next_rollout_id=None, directory=None):
        out = await original(self, next_rollout_id, directory)
        if directory is not None and next(saves) == at:  # a checkpoint's, not a console's call
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return out

    RolloutManager.state = state
    print(run_event_loop(launch(config)).summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
