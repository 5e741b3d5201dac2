"""The version clock, the rollout manager and the launcher (which serves those two) do not import
torch (~200 MiB RSS per process that loads the torch runtime: VmRSS after ``import torch``),
and with the embedded tokenizer not transformers either (~30 MiB RSS).

An actor process imports its start (``replayrl.actors.child_process``), then the actor
bootstrap (``replayrl.actors.actor_process``), then its actor class. A fresh interpreter does the same here and
reports which heavy packages ``sys.modules`` holds after each step; the rollout manager is also
built (its tokenizer and prompts loaded) with the tokenizer class the launcher resolves
(``replayrl.rollout.text.tokenizer_class``). The launcher does its torch and tokenizer work in a short
child (``replayrl.tools.run.initial_files``): a one-step ``replayrl train`` reports what its own
process imported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from replayrl.rollout.text.tokenizer_class import resolve_tokenizer_class
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.initial_files import Resolved
from replayrl.tools.run.launcher import actor_specs, resolve_engine, write_initial_checkpoint
from tests.child_env import PYTHONPATH

HEAVY = ("torch", "transformers")

PROBE = """
import json, sys
import replayrl.actors.child_process  # the child's entry (child_main)
import replayrl.actors.actor_process  # the actor process's main
from replayrl.actors.objects import import_actor_class
loaded = {}
for name, cls, kwargs in json.loads(sys.argv[1]):
    actor = import_actor_class(cls)
    if kwargs is not None:
        actor(**kwargs)
        name += " built"
    loaded[name] = sorted(m for m in %r if m in sys.modules)
print(json.dumps(loaded))
""" % (HEAVY,)


def test_clock_and_manager_processes_import_no_torch(tmp_path):
    config = build_config({})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    resolved = Resolved(resolve_engine(config), "float32", resolve_tokenizer_class(checkpoint))
    specs = {s.name: s for s in actor_specs(config, checkpoint, resolved=resolved)}
    # the engine last: it needs torch, which shows the probe sees an import when there is one
    order = [["version_clock", specs["version_clock"].cls, None],
             ["rollout_manager", specs["rollout_manager"].cls, None],
             ["rollout_manager", specs["rollout_manager"].cls, specs["rollout_manager"].kwargs],
             ["engine_0", specs["engine_0"].cls, None]]
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(order)], capture_output=True,
                         text=True, timeout=180, env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    # built, the manager reads the embedded tokenizer with the tokenizers library alone
    # (replayrl.rollout.text.backend_tokenizer): no transformers either
    assert loaded == {"version_clock": [], "rollout_manager": [], "rollout_manager built": [],
                      "engine_0": ["torch"]}


LAUNCHER = """
import atexit, runpy, sys
atexit.register(lambda: print("LAUNCHER", sorted(m for m in %r if m in sys.modules)))
sys.argv = ["replayrl"] + sys.argv[1:]
runpy.run_module("replayrl.tools.cli", run_name="__main__")
""" % (HEAVY,)


def test_the_launcher_process_imports_no_torch(tmp_path):
    args = ["train", "--num-steps", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--no-progress", "--output-dir", str(tmp_path / "run")]
    out = subprocess.run([sys.executable, "-c", LAUNCHER, *args], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    # it serves the rollout manager (the tokenizers library alone for the embedded tokenizer);
    # the checkpoint and the prompt data check are the initial-files child's, which has torch
    assert out.stdout.strip().splitlines()[-1] == "LAUNCHER []"


LORA_CHECK = """
import sys
from replayrl.tools.run.from_flags import build_config
config = build_config({"lora-rank": 8})
assert config.trainer.lora_rank == 8
print("LORA", sorted(m for m in %r if m in sys.modules))
""" % (HEAVY,)


def test_validating_a_lora_config_imports_no_torch():
    # --lora-rank checks its target modules (trainer/lora/settings.py), not trainer/lora/peft_adapter.py's torch
    out = subprocess.run([sys.executable, "-c", LORA_CHECK], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "LORA []"
