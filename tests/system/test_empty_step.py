"""A step with nothing to train, on the real multi-process system
(docs/design/rejection-sampling.md#rejection-sampling, "Steps with nothing to train").

Whichever ``--rs-denominator``: no weight, optimizer moment or version moves, the row says
``skipped: 1``, nothing is pushed, and the run goes on -- or, with ``--stop-on-empty-step``,
ends with ``EmptyStep`` and nothing applied.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import tempfile

import pytest

from replayrl.actors import Directory, RemoteError, Supervisor
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import actor_specs, launch, write_initial_checkpoint
from replayrl.tools.run.train_loop import train_loop

# 2 groups x 2 samples x 2 response tokens = 8 loss tokens per step. A geometric ratio of 1e30
# needs a mean d_t >= 69 nats: no sampled token is that unlikely, so 0 of 8 tokens pass.
REJECT_ALL = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "rollout-max-response-len": 2,
              "progress": False, "rs-mode": "geometric", "rs-lower": 1e30, "rs-upper": 1e30}


async def _run(tmp_path, settings: dict):
    """Run the train loop on real actor processes; returns the rows, the trainer's weight
    digest before and after, and the clock's state."""
    config = build_config({**settings, "output-dir": str(tmp_path)})
    specs = actor_specs(config, write_initial_checkpoint(config, tmp_path / "ckpt"))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        directory = Directory.for_run(run_dir, [s.name for s in specs])
        async with Supervisor(specs, directory, run_dir):
            trainer = directory.proxy("trainer")
            before = await trainer.weights_digest()
            await train_loop(directory, config, rows.append)
            after = await trainer.weights_digest()
            clock = await directory.proxy("version_clock").state()
    return rows, before, after, clock


@pytest.mark.parametrize("denominator", ["loss_tokens", "accepted_tokens"])
async def test_steps_without_accepted_tokens_are_skipped_alike(tmp_path, denominator):
    rows, before, after, clock = await _run(
        tmp_path, {**REJECT_ALL, "num-steps": 2, "rs-denominator": denominator})
    assert before == after  # weights and Adam moments bitwise unchanged
    assert clock["trainer_version"] == 0 and set(clock["engine_versions"].values()) == {0}
    assert [r["step"] for r in rows] == [0, 1]  # the run went on and wrote every row
    for r in rows:
        assert (r["skipped"], r["skip_reason"]) == (1, "no_accepted_tokens")
        assert r["loss_tokens"] > 0 and (r["accepted_tokens"], r["trained_groups"]) == (0, 0)
        assert r["rs_degenerate_groups"] == 2 and r["trainer_version"] == 0
        assert r["staleness_max"] == 0  # every batch was generated at the unchanged version 0
        assert r["weight_push_bytes"] == 0 and "grad_norm" not in r


async def test_skipped_and_trained_steps_keep_the_clock_and_the_window(tmp_path, caplog):
    # even rollouts reject everything, odd ones accept everything (tests/skipping_trainer.py).
    # step 0 skipped at t=0; step 1 trains its batch (generated at 0) at t=0 -> t=1, push 1;
    # step 2's batch was generated during step 1 at 0, so staleness 1 at t=1, skipped, no push;
    # step 3's batch was generated during step 2 at 1: staleness 0, trains -> t=2.
    config = build_config({**REJECT_ALL, "num-steps": 4, "output-dir": str(tmp_path)})
    specs = [dataclasses.replace(s, cls="tests.skipping_trainer:SkipEvenSteps") if s.name == "trainer"
             else s for s in actor_specs(config, write_initial_checkpoint(config, tmp_path / "ckpt"))]
    with caplog.at_level(logging.WARNING, logger="replayrl"):
        result = await launch(config, specs=specs)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [1, 0, 1, 0]
    assert [r["trainer_version"] for r in rows] == [0, 1, 1, 2]
    assert [r["staleness_max"] for r in rows] == [0, 0, 1, 0]
    assert [r["weight_push_bytes"] > 0 for r in rows[:3]] == [False, True, False]
    assert [r["accepted_tokens"] == (0 if r["skipped"] else r["loss_tokens"]) for r in rows] == [True] * 4
    assert [r.get("skip_reason") for r in rows] == ["no_accepted_tokens", None] * 2
    # the launcher says so, and the summary counts them
    assert "step 0 skipped (no_accepted_tokens)" in caplog.text
    assert "step 2 skipped (no_accepted_tokens)" in caplog.text
    assert "4 steps (2 skipped)" in result.summary


async def test_stop_on_empty_step_ends_the_run_with_nothing_applied(tmp_path):
    config = build_config({**REJECT_ALL, "num-steps": 3, "output-dir": str(tmp_path),
                           "stop-on-empty-step": True})
    with pytest.raises(RemoteError) as info:
        await launch(config)
    assert info.value.remote_type == "EmptyStep" and "no_accepted_tokens" in str(info.value)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
