"""The torchrun launcher: one actor per rank, driver on rank 0, over loopback tcp."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_env import PYTHONPATH
from tests.paths import REPO
from tests.ports import port_block


def _torchrun(nproc: int, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
         f"--master-port={port_block()}", "-m", "replayrl.tools.run.torchrun_entry", "--num-steps", "2",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--no-progress",
         "--output-dir", str(out), *extra],
        cwd=REPO, env={**os.environ, "PYTHONPATH": PYTHONPATH, **(env or {})},
        capture_output=True, text=True, timeout=240)


def test_three_ranks_train_two_steps(tmp_path, curve_keys_dir):
    proc = _torchrun(3, tmp_path, "--curve-keys", curve_keys_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["trainer_version"] for r in rows] == [1, 2]
    assert [r["staleness_max"] for r in rows] == [0, 1]
    assert "last10%=" in proc.stdout
    # rank 0 writes the run's record as `replayrl train` does; it gives the settings back
    import argparse

    from replayrl.tools.run.flags import add_run_flags
    from replayrl.tools.run.from_flags import config_from_args

    record = json.loads((tmp_path / "config.json").read_text())
    assert (record["num_steps"], record["num_engines"], record["rollout"]["rollout_batch_size"]) == (2, 1, 2)
    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    again = config_from_args(parser.parse_args(["--config", str(tmp_path / "config.json")]))
    assert again.to_json() == (tmp_path / "config.json").read_text()


def test_too_few_ranks_fail_closed(tmp_path):
    proc = _torchrun(2, tmp_path)
    assert proc.returncode != 0
    assert "--nproc-per-node >= 3" in proc.stderr


def test_ranks_refuse_to_start_without_curve_keys(tmp_path):
    proc = _torchrun(3, tmp_path)
    assert proc.returncode != 0
    assert "--curve-keys" in proc.stderr


def test_each_rank_listens_on_its_own_address_toward_the_master():
    import pytest

    from replayrl.actors import ActorSpec
    from replayrl.tools.errors import RendezvousError
    from replayrl.tools.run.rank_hosts import own_address
    from replayrl.tools.run.torchrun_entry import directory_for

    assert own_address("127.0.0.1", 29500) == "127.0.0.1"  # one node: the loopback route
    with pytest.raises(RendezvousError, match="MASTER_ADDR=no-such-host.invalid"):
        own_address("no-such-host.invalid", 29500)
    specs = [ActorSpec(n, "x:Y") for n in ("version_clock", "engine_0", "rollout_manager", "trainer")]
    hosts = {"version_clock": "10.0.0.1", "engine_0": "10.0.0.1", "rollout_manager": "10.0.0.1",
             "trainer": "fd00::2"}
    directory = directory_for(specs, hosts, 29500, "keys")
    assert directory.to_dict() == {"version_clock": "tcp://10.0.0.1:29501",
                                   "engine_0": "tcp://10.0.0.1:29502",
                                   "rollout_manager": "tcp://10.0.0.1:29503",
                                   "trainer": "tcp://[fd00::2]:29504"}
@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_two_trainer_ranks_under_torchrun(tmp_path, curve_keys_dir, backend):
    # 4 ranks: driver, one engine, the trainer and trainer_1 (docs/design/trainer-ranks.md#trainer-ranks);
    # the fsdp backend's ranks meet in the same group and shard the policy over it
    proc = _torchrun(4, tmp_path, "--curve-keys", curve_keys_dir, "--dp-size", "2",
                     "--train-backend", backend)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["trainer_version"] for r in rows] == [1, 2]
    assert [r["loss_tokens"] > 0 for r in rows] == [True, True]
    # every trainable parameter gets a gradient each step (tests/unit/rollout/test_model_expert_stack.py):
    # DDP is not asked to look for unused ones, and so does not warn that it found none
    assert "find_unused_parameters" not in proc.stderr


def test_a_dsa_family_trains_on_two_fsdp_ranks_under_torchrun(tmp_path, curve_keys_dir):
    # a tiny GLM-5 (transformers' glm_moe_dsa with our router / indexer hooks) sharded over
    # trainer and trainer_1, every replay on: the engine's experts and keys are used (flips 0)
    pytest.importorskip("transformers", reason="checkpoints are written by transformers")
    from tests.family_checkpoints import tiny_hf_checkpoint

    tiny_hf_checkpoint("glm_moe_dsa", tmp_path / "glm5")
    proc = _torchrun(4, tmp_path / "run", "--curve-keys", curve_keys_dir, "--dp-size", "2",
                     "--train-backend", "fsdp", "--hf-checkpoint", str(tmp_path / "glm5"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["trainer_version"] for r in rows] == [1, 2]
    assert all(r["loss_tokens"] > 0 for r in rows)
    assert all(r["routing_flip_rate"] == r["indexer_flip_rate"] == 0.0 for r in rows)


def test_the_plan_gives_the_last_ranks_to_the_trainer_ranks(tmp_path):
    from replayrl.tools.errors import ConfigError
    from replayrl.tools.run.from_flags import build_config
    from replayrl.tools.run.torchrun_entry import plan

    config = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "dp-size": 2,
                           "output-dir": str(tmp_path)})
    specs, roles = plan(5, config, base_port=40000)
    assert roles == {0: ["version_clock", "rollout_manager"], 1: ["engine_0"], 2: ["engine_1"],
                     3: ["trainer"], 4: ["trainer_1"]}
    # the trainer ranks meet on the port after the six actors' (40001 .. 40006)
    assert next(s for s in specs if s.name == "trainer").kwargs["ranks"]["port"] == 40007
    with pytest.raises(ConfigError, match="--nproc-per-node >= 4"):
        plan(3, config)  # no room for a driver, an engine and 2 trainer ranks
    # megatron TP=2: --dp-size 1 x --tp-size 2 trainer ranks, the rest engines
    tp = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "train-backend": "megatron",
                       "tp-size": 2, "output-dir": str(tmp_path)})
    _, roles = plan(4, tp)
    # the ranks decide the engines: an --num-engines that differs is refused, naming both;
    # the default (1) and the plan's own count are accepted
    assert [s.name for s in plan(5, config)[0] if s.name.startswith("engine_")] == ["engine_0",
                                                                                   "engine_1"]
    plan(5, build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "dp-size": 2,
                          "num-engines": 2, "output-dir": str(tmp_path)}))
    four = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "num-engines": 4,
                         "output-dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="--num-engines 4 differs from the 1 engine"):
        plan(3, four)
    with pytest.raises(ConfigError, match="--num-engines 4 differs from the 3 engine"):
        plan(2, four, joined=3)  # a joined host plans the same way
    assert roles == {0: ["version_clock", "rollout_manager"], 1: ["engine_0"], 2: ["trainer"],
                     3: ["trainer_1"]}


def test_trainer_ranks_meet_at_the_trainer_actors_host(tmp_path):
    from replayrl.tools.run.from_flags import build_config
    from replayrl.tools.run.torchrun_entry import plan, with_trainer_group_host

    config = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "dp-size": 2,
                           "output-dir": str(tmp_path)})
    specs, _ = plan(5, config, base_port=40000)
    moved = {s.name: s for s in with_trainer_group_host(specs, "10.0.0.7")}
    assert moved["trainer"].kwargs["ranks"]["host"] == "10.0.0.7"
    assert moved["trainer_1"].kwargs["group"] == {**next(
        s for s in specs if s.name == "trainer_1").kwargs["group"], "host": "10.0.0.7"}
    assert moved["engine_0"] == next(s for s in specs if s.name == "engine_0")


def test_ready_timeout_is_explained_in_the_help(capsys):
    from replayrl.tools.run.torchrun_entry import main

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--ready-timeout SECONDS how long the ranks (and joined engines) may take" in help_text
