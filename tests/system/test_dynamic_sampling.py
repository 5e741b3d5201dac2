"""A short `replayrl train --dynamic-sampling` run (the launcher, real actor processes): every
step reports the configured group count and the drop / refill counts add up (which groups drop
is tested by hand in tests/unit/trainer/test_dynamic_sampling*.py). With wandb installed the
same run also has --use-wandb (WANDB_MODE=offline): its W&B run holds every numeric value of
every metrics.jsonl row."""
from __future__ import annotations

import importlib.util
import json

from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import launch
from tests.wandb_records import offline_run

GROUPS = 2


async def test_every_step_trains_on_the_configured_group_count(tmp_path, monkeypatch):
    use_wandb = importlib.util.find_spec("wandb") is not None
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = build_config({"rollout-batch-size": GROUPS, "n-samples-per-prompt": 4,
                           "num-steps": 4, "progress": False, "output-dir": str(tmp_path),
                           "dynamic-sampling": True, "rs-refill-max-rounds": 16,
                           "use-wandb": use_wandb})
    result = await launch(config)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert (r["skipped"], r["trained_groups"], r["admitted_groups"]) == (0, GROUPS, GROUPS)
        detail = r["refill_round_detail"]
        assert len(detail) == r["refill_rounds"] + 1
        # every dropped group had equal rewards (no RS gate); per-round counts add up
        assert r["zero_variance_groups"] == r["rejected_groups"] == sum(
            d["zero_variance_groups"] for d in detail)
        candidates = sum(d["candidate_groups"] for d in detail)
        assert candidates == GROUPS + r["rejected_groups"] + r["surplus_groups"]
        assert r["generated_samples"] == 4 * candidates
    assert [r["trainer_version"] for r in rows] == [1, 2, 3, 4]
    assert [r["step"] for r in result.rows] == [0, 1, 2, 3]
    if use_wandb:
        _, history = offline_run(tmp_path)
        assert len(history) == 4
        for row, logged in zip(rows, history):
            numbers = {k: v for k, v in row.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            assert {k: v for k, v in logged.items() if not k.startswith("_")} == numbers
            assert "support_entropy_mean" in numbers and "zero_variance_groups" in numbers
