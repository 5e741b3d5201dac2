"""Which processes the chaos soak (``replayrl bench faults --chaos``) may kill: this process's
live children named as engine actors (``comm`` ``rrl:engine_*``), no other."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from replayrl.tools.bench.chaos import engine_pids

NAMED = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, sys.argv[1].encode()); "
         "print(flush=True); time.sleep(60)")
"""A child that sets its ``comm`` name (prctl PR_SET_NAME = 15) and then waits."""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_only_live_engine_children_are_targets():
    names = ("rrl:engine_0", "rrl:engine_1", "rrl:trainer")
    children = [subprocess.Popen([sys.executable, "-c", NAMED, n], stdout=subprocess.PIPE)
                for n in names]
    try:
        for child in children:
            child.stdout.readline()  # named by now
        assert engine_pids() == {"rrl:engine_0": children[0].pid, "rrl:engine_1": children[1].pid}
        os.kill(children[1].pid, signal.SIGKILL)  # dead, not yet reaped: a zombie is no target
        for _ in range(100):
            if "rrl:engine_1" not in engine_pids():
                break
            time.sleep(0.02)
        assert engine_pids() == {"rrl:engine_0": children[0].pid}
        assert engine_pids(parent=children[0].pid) == {}  # another process's children: none
    finally:
        for child in children:
            child.kill()
            child.wait()
