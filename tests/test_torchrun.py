"""The torchrun launcher: one actor per rank, driver on rank 0, over loopback tcp."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
         f"--master-port={_free_port()}", "-m", "tools.torchrun_entry", "--num-steps", "2",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--no-progress",
         "--output-dir", str(out), *extra],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True, text=True, timeout=240)


def test_three_ranks_train_two_steps(tmp_path, curve_keys_dir):
    proc = _torchrun(3, tmp_path, "--curve-keys", curve_keys_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["trainer_version"] for r in rows] == [1, 2]
    assert [r["staleness_max"] for r in rows] == [0, 1]
    assert "last10%=" in proc.stdout


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

    from actors import ActorSpec
    from tools.rank_hosts import RendezvousError, own_address
    from tools.torchrun_entry import directory_for

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
