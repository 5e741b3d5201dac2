"""Run a benchmark ahead of other jobs on a shared Linux machine (``--priority``).

Linux groups the processes of each session (terminal, ssh login, CI job) into an *autogroup*
and shares the CPU fairly between groups, so ``nice`` inside one session does not put it ahead
of another session's jobs. ``/proc/self/autogroup`` sets the nice value of the whole group
(sched(7), "The autogroup feature"); at -20 the benchmark's processes (its spawned actors and
TRL's process inherit the group) get the CPU whenever they are runnable, which on a machine
shared with other sessions gives figures close to a quiet machine's. Lowering the value needs
root (CAP_SYS_NICE); the previous value is restored on exit.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from replayrl.tools.errors import PriorityError

AUTOGROUP = Path("/proc/self/autogroup")


def _read() -> int:
    # the file reads "/autogroup-487 nice 0"
    try:
        return int(AUTOGROUP.read_text().split()[-1])
    except (OSError, ValueError, IndexError) as exc:
        raise PriorityError(f"{AUTOGROUP}: cannot read the autogroup nice value ({exc}); "
                            f"the kernel needs CONFIG_SCHED_AUTOGROUP") from None


def _write(nice: int) -> None:
    try:
        AUTOGROUP.write_text(f"{nice}\n")
    except OSError as exc:
        raise PriorityError(f"{AUTOGROUP}: cannot set nice {nice} ({exc}); --priority needs "
                            f"root") from None


@contextlib.contextmanager
def autogroup_priority(enabled: bool, nice: int = -20) -> Iterator[None]:
    """Within the block, this process's autogroup runs at ``nice`` (-20 = first); a no-op when
    ``enabled`` is False.

    Raises:
        PriorityError: autogroups are unsupported or the value cannot be set (not root).
    """
    if not enabled:
        yield
        return
    before = _read()
    _write(nice)
    try:
        yield
    finally:
        _write(before)
