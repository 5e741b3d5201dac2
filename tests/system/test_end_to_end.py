"""Short end-to-end runs of the real multi-process system on the embedded default."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from replayrl.actors import Directory, RemoteError, Supervisor
from replayrl.rollout.model.config import default_config
from replayrl.rollout.sample import samples_from_columns
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import actor_specs, launch, write_initial_checkpoint
from tests.child_env import PYTHONPATH
from tests.paths import REPO

SMALL = {"rollout-batch-size": 4, "n-samples-per-prompt": 4, "progress": False}


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


async def test_short_run_overlaps_generation_with_one_step_staleness(tmp_path):
    config = build_config({**SMALL, "num-steps": 3, "output-dir": str(tmp_path)})
    result = await launch(config)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # batch 0 is generated before any update (staleness 0), later ones one version behind
    assert [r["staleness_max"] for r in rows] == [0, 1, 1]
    assert [r["trainer_version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["samples"] == 16
        for key in ("response_len_mean", "train_rollout_logprob_abs_diff", "generate_seconds",
                    "train_seconds", "step_seconds"):
            assert np.isfinite(r[key])
    # bf16 engine vs fp32 trainer on the same weights, all replays on: small but nonzero
    assert 0 < rows[0]["train_rollout_logprob_abs_diff"] < 0.05
    assert result.plot_path.exists() and "last10%=" in result.summary


async def test_max_staleness_zero_trains_on_policy_in_sequence(tmp_path):
    config = build_config({**SMALL, "num-steps": 3, "max-staleness": 0, "save-interval": 2,
                           "output-dir": str(tmp_path)})
    result = await launch(config)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # every batch came from the weights the step trains (the clock's window [0, 0] would have
    # refused a batch generated before the previous push)
    assert [r["staleness_max"] for r in rows] == [0, 0, 0]
    assert [r["trainer_version"] for r in rows] == [1, 2, 3]
    for r in rows:  # generation and training do not overlap: each side waits the other out
        assert r["wait_for_rollout_seconds"] > 0 and r["wait_for_trainer_seconds"] > 0
    state = json.loads((tmp_path / "checkpoints" / "step-2" / "run_state.json").read_text())
    assert state["next_step"] == 2 and state["clock"]["max_staleness"] == 0
    assert state["clock"]["trainer_version"] == 2


async def test_trainer_dying_while_saving_ends_the_run_and_keeps_the_last_checkpoint(tmp_path):
    from replayrl.actors import ActorDied
    from replayrl.tools.run.launcher import check_load

    config = build_config({**SMALL, "num-steps": 4, "save-interval": 1, "output-dir": str(tmp_path)})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    specs = [dataclasses.replace(s, cls="tests.failing_trainer:DiesWhileSaving")
             if s.name == "trainer" else s for s in actor_specs(config, checkpoint)]
    with pytest.raises(ActorDied) as died:
        await launch(config, specs=specs)
    assert died.value.actor == "trainer" and died.value.exitcode == 9
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step-1", "step-2.partial"]  # the half-written one is not named a checkpoint
    resume = build_config({**SMALL, "num-steps": 4, "output-dir": str(tmp_path / "again"),
                           "load": str(tmp_path / "checkpoints" / "step-1")})
    assert check_load(resume) == 1  # every file of the last checkpoint reads back and fits


async def test_traces_cross_the_wire_with_design_shapes(tmp_path):
    config = build_config({**SMALL, "num-steps": 1, "output-dir": str(tmp_path)})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        specs = actor_specs(config, checkpoint)
        directory = Directory.for_run(run_dir, [s.name for s in specs])
        async with Supervisor(specs, directory, run_dir):
            manager = directory.ref("rollout_manager")
            with pytest.raises(RemoteError, match="EngineNotReady"):
                await manager.call("generate", 0)  # no weights loaded yet in this run
            await directory.ref("trainer").call("push_weights")
            await manager.call("generate", 1)
            samples = samples_from_columns(await manager.call("take_batch", 1))
    mc = default_config(len(VOCABULARY))
    assert len(samples) == 16
    for s in samples:
        P, R = len(s.prompt_ids), len(s.response_ids)
        assert s.sample_support.dtype == np.int32 and s.sample_support.shape == (R, 1 + config.rollout.top_k)
        assert (s.sample_support[:, 0] == s.response_ids).all()
        assert s.routed_experts.dtype == np.int32
        assert s.routed_experts.shape == (P + R - 1, len(mc.moe_layers), mc.num_experts_per_tok)
        assert s.indexer_topk.dtype == np.int32
        assert s.indexer_topk.shape == (P + R - 1, len(mc.indexed_layers), mc.index_topk)
        assert ((s.routed_experts >= 0) & (s.routed_experts < mc.num_experts)).all()
        # indexer keys are causal token positions of this sample, or -1
        rows = np.arange(P + R - 1)[:, None, None]
        keys = s.indexer_topk
        assert ((keys == -1) | ((keys >= 0) & (keys <= rows))).all()
        assert np.isfinite(s.rollout_logprobs).all() and (s.rollout_logprobs <= 0).all()
        assert s.policy_version == 0


async def test_actor_exception_ends_run_with_its_traceback_and_leaves_nothing(tmp_path):
    config = build_config({**SMALL, "num-steps": 5, "output-dir": str(tmp_path)})
    checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    specs = [dataclasses.replace(s, cls="tests.failing_trainer:FailingTrainer")
             if s.name == "trainer" else s for s in actor_specs(config, checkpoint)]
    before = set(_children(os.getpid()))
    start = time.monotonic()
    with pytest.raises(RemoteError, match="injected failure in step 1") as info:
        await launch(config, specs=specs)
    assert "failing_trainer.py" in info.value.remote_traceback
    assert time.monotonic() - start < 120
    assert not [p for p in set(_children(os.getpid())) - before if _alive(p)]


def _train_until_first_step(tmp_path, tmp, sigint):
    """``replayrl train`` (500 steps) in a child whose SIGINT disposition is ``sigint`` and
    whose ``TMPDIR`` (the actors' ipc files) is ``tmp``, returned once its first step is in
    metrics.jsonl. The disposition is set explicitly: pytest started
    as a shell's background job has SIGINT ignored, and a child inherits that."""
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": PYTHONPATH}
    proc = subprocess.Popen(
        [sys.executable, "-m", "replayrl.tools.cli", "train", "--num-steps", "500", "--no-progress",
         "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
         "--output-dir", str(tmp_path / "out")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no step finished in time"
        time.sleep(0.2)
    return proc, metrics, tmp


def _assert_stopped_clean(proc, actors, tmp, code):
    # a hang guard, not a speed claim: the shutdown must not wait out the 300 s call timeouts
    # (a 15 s assertion failed at 17.5 s on a machine at load 12)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == code, err
    # a clean stop logs no error: replies to the launcher that left are dropped quietly, and
    # the signal unwinds the run, not an actor task the launcher serves (tools/run/exit_codes.py)
    assert "ERROR" not in err and "Traceback" not in err, err
    # actors are gone at exit; multiprocessing's resource tracker follows within moments
    deadline = time.monotonic() + 5
    while [p for p in actors if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in actors if _alive(p)]
    assert [p for p in tmp.iterdir() if p.name.startswith("replayrl-")] == []  # ipc dir gone


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_every_process_and_removes_ipc_files(tmp_path, ipc_tmp, signum, code):
    proc, _, tmp = _train_until_first_step(tmp_path, ipc_tmp, signal.SIG_DFL)
    try:
        actors = _children(proc.pid)
        # engine and trainer (the launcher serves the clock and the manager itself)
        assert len([p for p in actors if _alive(p)]) >= 2
        proc.send_signal(signum)
        _assert_stopped_clean(proc, actors, tmp, code)
    finally:  # a failed assertion must not leave a 500-step run behind
        proc.kill()
        proc.communicate()


def test_an_inherited_ignored_sigint_is_honoured_and_sigterm_still_stops(tmp_path, ipc_tmp):
    # the documented choice (docs/launchers.md): `replayrl train ... &` from a script, or under
    # nohup-style wrappers, keeps running through the terminal's Ctrl-C, as Python itself and
    # POSIX shells intend for background jobs; SIGTERM is the way to stop such a run
    proc, metrics, tmp = _train_until_first_step(tmp_path, ipc_tmp, signal.SIG_IGN)
    try:
        actors = _children(proc.pid)
        proc.send_signal(signal.SIGINT)
        steps = len(metrics.read_text().splitlines())
        deadline = time.monotonic() + 120
        while len(metrics.read_text().splitlines()) < steps + 2:  # two more steps after the SIGINT
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no step after SIGINT"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _assert_stopped_clean(proc, actors, tmp, 143)
    finally:
        proc.kill()
        proc.communicate()


async def test_replay_check_from_config_stops_a_step_listing_mismatches(tmp_path):
    # one optimizer step later the trainer's own routers disagree with the engine's on most
    # tokens (see routing_drift_rate); a strict bound must stop that step, naming the rows
    config = build_config({**SMALL, "num-steps": 3, "output-dir": str(tmp_path),
                           "replay-max-mismatch-fraction": 0.05})
    with pytest.raises(RemoteError, match="routing replay mismatch") as info:
        await launch(config)
    assert info.value.remote_type == "ReplayMismatch" and "first mismatches: token" in str(info.value)
