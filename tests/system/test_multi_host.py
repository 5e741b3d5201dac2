"""The torchrun launcher across hosts: two test hosts made as network namespaces joined by a veth
pair (iproute2), one run training across them over CURVE tcp, and one surviving the cut of an
engine host's link (docs/design/multi-host.md#attach-and-multi-host, docs/design/engine-faults.md#engine-faults).

Needs root and ``ip netns`` (CI runs as root); skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.child_env import PYTHONPATH
from tests.paths import REPO

SUBNET = "10.213.7"  # private, and only inside the two namespaces


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _why_not() -> str:
    """Why two namespace hosts cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    probe = f"rrlprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"ip netns add is refused here: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return ""


@pytest.fixture
def two_hosts():
    """Namespaces A (``SUBNET.1``) and B (``SUBNET.2``) joined by one veth pair, as
    ``[(namespace, address, veth end), ...]``; removed after."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = str(os.getpid())
    hosts = [(f"rrl{tag}a", f"rv{tag}a", f"{SUBNET}.1"), (f"rrl{tag}b", f"rv{tag}b", f"{SUBNET}.2")]
    try:
        for ns, _, _ in hosts:
            assert _ip("netns", "add", ns).returncode == 0
        (ns_a, veth_a, _), (ns_b, veth_b, _) = hosts
        assert _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b).returncode == 0
        for ns, veth, address in hosts:
            for command in (("link", "set", veth, "netns", ns),
                            ("-n", ns, "addr", "add", f"{address}/24", "dev", veth),
                            ("-n", ns, "link", "set", veth, "up"),
                            ("-n", ns, "link", "set", "lo", "up")):
                done = _ip(*command)
                assert done.returncode == 0, done.stderr
        yield [(ns, address, veth) for ns, veth, address in hosts]
    finally:
        for ns, _, _ in hosts:
            _ip("netns", "del", ns)  # takes its end of the veth pair with it


def _torchrun(ns: str, node_rank: int, master: str, out: Path, keys: str, env: dict,
              *extra: str, entry: str = "replayrl.tools.run.torchrun_entry") -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
         f"--node-rank={node_rank}", "--nproc-per-node=2", f"--master-addr={master}",
         "--master-port=29500", "-m", entry, "--curve-keys", keys,
         "--num-steps", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--no-progress", "--output-dir", str(out), *extra],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_run_trains_across_two_namespace_hosts(two_hosts, tmp_path, curve_keys_dir):
    """Ranks 0-1 on host A, 2-3 on host B; a console on host B attaches to the run by the address
    of an actor on host A while the first rollout's reward is held, pauses generation and
    detaches; the run then finishes."""
    from tests.hook_fixtures import HOLD_ENV

    (ns_a, addr_a, _), (ns_b, addr_b, _) = two_hosts
    release = tmp_path / "release"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "TMPDIR": str(tmp_path), HOLD_ENV: str(release)}
    out_a, out_b = tmp_path / "host-a", tmp_path / "host-b"  # no shared directory is needed
    hold = ("--custom-reward", "tests.hook_fixtures:held_reward", "--reward-timeout-seconds", "300")
    node_a = _torchrun(ns_a, 0, addr_a, out_a, curve_keys_dir, env, *hold)
    node_b = _torchrun(ns_b, 1, addr_a, out_b, curve_keys_dir, env, *hold)
    card = None
    try:
        deadline = time.monotonic() + 300  # bounded wait for the run to serve, not a timing test
        # and to be held in the first reward (both engines loaded by then): the console's CLOCK
        # line reads the engines' versions, empty before the first weight load
        held = tmp_path / "release.waiting"  # tests/hook_fixtures.py's marker
        while (card is None or not held.exists()) and node_a.poll() is None \
                and time.monotonic() < deadline:
            try:
                card = card or json.loads((out_a / "attach.json").read_text())
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        console = subprocess.run(
            ["ip", "netns", "exec", ns_b, sys.executable, "-m", "replayrl.tools.cli", "repl", "--attach",
             f"tcp://{addr_a}:29501", "--curve-keys", curve_keys_dir],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
            input="print('NAMES', sorted(actors))\nprint('CLOCK', version_clock.state())\n"
                  "print('TRAINER', trainer.__ping__()['pid'] > 0)\nprint('PAUSED', pause())\n")
        release.touch()
        out_text_a, err_a = node_a.communicate(timeout=300)
        _, err_b = node_b.communicate(timeout=120)
    finally:
        release.touch()
        for node in (node_a, node_b):
            if node.poll() is None:
                node.kill()
                node.wait()
    assert node_a.returncode == 0, err_a[-3000:]
    assert node_b.returncode == 0, err_b[-3000:]
    # ranks 0, 1 (clock + manager + driver, engine_0) on host A; ranks 2, 3 (engine_1, trainer)
    # on host B; actor i listens on its own host's address at MASTER_PORT + 1 + i
    assert card is not None and card["endpoints"] == {
        "version_clock": f"tcp://{addr_a}:29501", "engine_0": f"tcp://{addr_a}:29502",
        "engine_1": f"tcp://{addr_b}:29503", "rollout_manager": f"tcp://{addr_a}:29504",
        "trainer": f"tcp://{addr_b}:29505"}
    # the console on host B found every actor through version_clock on host A, with the keys
    assert console.returncode == 0, console.stderr
    assert f"NAMES {sorted(card['endpoints'])}" in console.stdout
    # held in rollout 0's reward: both engines loaded version 0 and nothing has trained yet
    assert ("CLOCK {'max_staleness': 1, 'trainer_version': 0, 'engine_versions': "
            "{'engine_0': 0, 'engine_1': 0}}") in console.stdout
    assert "TRAINER True" in console.stdout
    assert "PAUSED {'paused': True, 'in_flight': 0, 'held': 0}" in console.stdout
    assert "generation resumed" in console.stderr  # leaving undid the console's pause
    rows = [json.loads(line) for line in (out_a / "metrics.jsonl").read_text().splitlines()]
    assert [r["trainer_version"] for r in rows] == [1, 2]
    assert [r["staleness_max"] for r in rows] == [0, 1]
    assert all(r["samples"] == 4 for r in rows)
    assert "last10%=" in out_text_a
    assert (out_b / "checkpoint-init").is_dir() and not (out_a / "checkpoint-init").exists()


def test_dist_weight_sync_reaches_an_engine_on_each_host(two_hosts, tmp_path, curve_keys_dir):
    """``--weight-sync dist`` across the hosts: the trainer (rank 3, host B) hosts the weight
    group on B's address; engine_0 (host A) and engine_1 (host B) join it over the veth pair,
    and every push they loaded equals the trainer's, tensor by tensor (float32 engines)."""
    from tests.weight_recorders import WEIGHTS_ENV, recorded

    (ns_a, addr_a, _), (ns_b, _, _) = two_hosts
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "TMPDIR": str(tmp_path)}
    flags = ("--weight-sync", "dist", "--engine-dtype", "float32")
    entry = "tests.torchrun_record_entry"
    nodes = [_torchrun(ns, rank, addr_a, tmp_path / f"host-{rank}", curve_keys_dir,
                       {**env, WEIGHTS_ENV: str(tmp_path / f"weights-{rank}")}, *flags, entry=entry)
             for rank, ns in enumerate((ns_a, ns_b))]
    try:
        errors = [node.communicate(timeout=300)[1] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    assert [node.returncode for node in nodes] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    on_a, on_b = recorded(tmp_path / "weights-0"), recorded(tmp_path / "weights-1")
    assert {name for name, _ in on_a} == {"engine_0"}  # the plan of the first test's layout
    assert {name for name, _ in on_b} == {"engine_1", "trainer"}
    assert sorted(v for name, v in on_b if name == "trainer") == [0, 1]
    for (engine, version), got in {**on_a, **on_b}.items():
        if engine == "trainer":
            continue
        want = on_b[("trainer", version)]
        assert sorted(got) == sorted(want)
        for name, array in want.items():
            np.testing.assert_array_equal(got[name], array, err_msg=f"{engine} v{version} {name}")
    assert ("engine_0", 0) in on_a and ("engine_1", 0) in on_b
    rows = [json.loads(line) for line in (tmp_path / "host-0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["trainer_version"] for r in rows] == [1, 2]


# what a step trained on and what it computed (tests/system/test_engine_faults.py); timings and the
# capacity figures differ
TRAINED = ("prompt_indices", "samples", "reward_mean", "response_len_mean", "trainer_version",
           "staleness_max", "staleness_mean", "grad_norm", "train_rollout_logprob_abs_diff",
           "accepted_tokens")
CUT_RUN = ("--num-steps", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
           "--heartbeat-deadline-s", "3", "--no-progress")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> list[dict]:
    """The rows of the same run as one ``replayrl train`` with two engines and no fault."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    from replayrl.actors import run_event_loop
    from replayrl.tools.run.from_flags import build_config
    from replayrl.tools.run.launcher import launch

    result = run_event_loop(launch(build_config({
        "num-steps": 3, "rollout-batch-size": 4, "n-samples-per-prompt": 4, "num-engines": 2,
        "progress": False, "output-dir": str(tmp_path_factory.mktemp("fault-free"))})))
    return [json.loads(line) for line in result.metrics_path.read_text().splitlines()]


@pytest.mark.parametrize("fault", ["cut", "kill"])
def test_a_lost_engine_host_is_regenerated_and_the_run_finishes(two_hosts, fault_free, tmp_path,
                                                                curve_keys_dir, fault):
    """Host A runs the run's torchrun (driver, engine_0, trainer); host B joins one engine
    (engine_1) with its own torchrun. engine_1 hangs in its chunk of rollout 1 (overlapping
    step 0), then B's link is cut (or the engine rank SIGKILLed): the driver loses engine_1
    at the heartbeat deadline, its two groups are generated again on engine_0, every step
    trains what a fault-free two-engine run trains, and host B's rank and torchrun exit by
    themselves."""
    from replayrl.tools.run.exit_codes import EXIT_DRIVER_LOST
    from tests.torchrun_fault_entry import FAULT_ENV

    (ns_a, addr_a, _), (ns_b, _, veth_b) = two_hosts
    reference = fault_free
    marker = tmp_path / "fault.json"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "TMPDIR": str(tmp_path)}
    common = ("--curve-keys", curve_keys_dir, *CUT_RUN)
    node_a = subprocess.Popen(
        ["ip", "netns", "exec", ns_a, sys.executable, "-m", "torch.distributed.run",
         "--nnodes=1", "--nproc-per-node=3", f"--master-addr={addr_a}", "--master-port=29500",
         "-m", "replayrl.tools.run.torchrun_entry", *common, "--joined-engines", "1",
         "--output-dir", str(tmp_path / "host-a")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node_b = subprocess.Popen(
        ["ip", "netns", "exec", ns_b, sys.executable, "-m", "torch.distributed.run",
         "--standalone", "--nproc-per-node=1", "-m", "tests.torchrun_fault_entry", *common,
         "--join-run", f"{addr_a}:29500", "--output-dir", str(tmp_path / "host-b")],
        cwd=REPO, env={**env, FAULT_ENV: f"engine_1:HANG:2:{marker}"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # bounded wait for rollout 1, not a timing test
        while not marker.exists() and node_a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "engine_1 never reached its chunk of rollout 1"
        if fault == "cut":
            cut = _ip("-n", ns_b, "link", "set", veth_b, "down")
            assert cut.returncode == 0, cut.stderr
        else:
            os.kill(json.loads(marker.read_text())["pid"], signal.SIGKILL)
        faulted = time.monotonic()
        _, err_b = node_b.communicate(timeout=120)  # B's rank and agent leave by themselves
        b_gone = time.monotonic() - faulted
        out_a, err_a = node_a.communicate(timeout=300)
    finally:
        for node in (node_a, node_b):
            if node.poll() is None:
                node.kill()
                node.wait()
    assert node_a.returncode == 0, err_a[-3000:]
    # host B: its rank lost the driver and exited with its own code (or was killed); its
    # torchrun reports it and ends
    assert node_b.returncode != 0
    if fault == "cut":
        assert "lost the driver" in err_b, err_b[-3000:]
    assert f"exitcode  : {EXIT_DRIVER_LOST if fault == 'cut' else -9}" in err_b, err_b[-3000:]
    hung = json.loads(marker.read_text())["pid"]
    assert not Path(f"/proc/{hung}").exists()
    rows = [json.loads(line) for line in (tmp_path / "host-a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["samples"] == 16 for r in rows)  # 4 groups x 4 samples, none lost or twice
    assert [r["groups_regenerated"] for r in rows] == [0, 2, 0]  # engine_1's two groups
    assert [r["engines_alive"] for r in rows] == [2, 1, 1]
    for row, ref in zip(rows, reference):
        for key in TRAINED:
            assert row[key] == ref[key], (row["step"], key)
    assert "last10%=" in out_a
    # the figures docs/benchmarks.md quotes (shown with -s; not asserted: no timed assertions)
    print(f"\n{fault}: host B's torchrun gone {b_gone:.1f} s after the fault; step 0 (waits "
          f"for rollout 1) {rows[0]['step_seconds']:.1f} s vs {reference[0]['step_seconds']:.1f} s "
          f"fault-free; deadline 3 s")
