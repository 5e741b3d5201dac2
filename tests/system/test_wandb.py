"""--use-wandb: the offline W&B run under the output directory holds every numeric metric of
every row at its step, and the run config (wandb starts its own service process, hence a
system test). Read back with tests/wandb_records.py, independently of the recorder."""
from __future__ import annotations

import json

import pytest

from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.metrics import MetricsRecorder
from tests.wandb_records import offline_run


def test_offline_run_holds_every_numeric_metric_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = build_config({"output-dir": str(tmp_path), "progress": False, "use-wandb": True,
                           "lr": 1e-3, "dynamic-sampling": True})
    rows = [{"step": 0, "reward_mean": 0.25, "eval/x/pass@1": 0.5, "skip_reason": "none",
             "support_entropy_mean": 1.5, "routing_flip_rate": 0.0, "indexer_drift_rate": 0.125,
             "prompt_indices": [3, 1], "zero_variance_groups": 2, "proximal_cache_pinned": False},
            {"step": 1, "reward_mean": 0.75, "support_entropy_mean": 1.25, "grad_norm": float("nan")}]
    with MetricsRecorder(tmp_path, 2, show_progress=False, config=config, wandb=True) as rec:
        for r in rows:
            rec.record(dict(r))
    logged_config, history = offline_run(tmp_path)
    assert logged_config == json.loads((config.to_json()))  # the run record, every setting
    assert logged_config["trainer"]["lr"] == 1e-3 and logged_config["trainer"]["dynamic_sampling"]
    assert [h["_step"] for h in history] == [0, 1]
    mine = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history]
    # every number, at its step; not the text, the lists, the bools or a non-finite value
    assert mine[0] == {"step": 0, "reward_mean": 0.25, "eval/x/pass@1": 0.5,
                       "support_entropy_mean": 1.5, "routing_flip_rate": 0.0,
                       "indexer_drift_rate": 0.125, "zero_variance_groups": 2}
    assert mine[1] == {"step": 1, "reward_mean": 0.75, "support_entropy_mean": 1.25}
