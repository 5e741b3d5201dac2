"""The version clock and the rollout manager do not import torch (issue 24, memory: ~200 MiB RSS
per process that loads the torch runtime).

A spawned actor process imports the launcher's main module again (``multiprocessing`` runs it
as ``__mp_main__``: ``replayrl.tools.cli`` for ``replayrl train``), then the spawn bootstrap
(``replayrl.actors.spawn``), then its actor class. A fresh interpreter does the same here and
reports which heavy packages ``sys.modules`` holds after each step. (The rollout manager still
loads torch at run time, through ``transformers.AutoTokenizer``: transformers 5 imports torch
whenever it is installed; see docs/benchmarks.md#peer-grid.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from replayrl.tools.run.config import build_config
from replayrl.tools.run.launcher import actor_specs
from tests.child_env import PYTHONPATH

HEAVY = ("torch", "transformers")

PROBE = """
import json, runpy, sys
from replayrl.actors.spawn import import_actor_class
runpy.run_module("replayrl.tools.cli", run_name="__mp_main__")  # as multiprocessing's spawn does
loaded = {}
for name, cls in json.loads(sys.argv[1]):
    import_actor_class(cls)
    loaded[name] = sorted(m for m in %r if m in sys.modules)
print(json.dumps(loaded))
""" % (HEAVY,)


def test_clock_and_manager_processes_import_no_torch(tmp_path):
    specs = {s.name: s.cls for s in actor_specs(build_config({}), tmp_path)}
    # the engine last: it needs torch, which shows the probe sees an import when there is one
    order = [[name, specs[name]] for name in ("version_clock", "rollout_manager", "engine_0")]
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(order)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == {"version_clock": [], "rollout_manager": [], "engine_0": ["torch"]}
