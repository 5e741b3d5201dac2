"""A flip rate with nothing compared is undefined: ``null`` in the metrics and ``n/a`` in the
progress line, never 0.0 (which would claim a perfect replay). Traces of only ``-1`` rows are
accepted as "nothing captured" and the step trains on the trainer's own choices."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from replayrl.rollout.sample import Sample
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint
from replayrl.tools.run.metrics import MetricsRecorder, progress_status
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.ranks.trainer_actor import TrainerActor
from replayrl.trainer.replay.checks import mean_rates
from replayrl.transport import strict_json


def test_mean_rates_by_hand():
    nan = math.nan
    got = mean_rates({"routing_flip_rate": [nan, 0.5, 0.25], "routing_drift_rate": [nan, nan],
                      "indexer_flip_rate": [0.0, 0.0], "indexer_drift_rate": []})
    # (0.5 + 0.25) / 2 over the two compared microbatches; nothing compared -> None
    assert got == {"routing_flip_rate": 0.375, "routing_drift_rate": None,
                   "indexer_flip_rate": 0.0, "indexer_drift_rate": None}
    assert list(got) == ["routing_flip_rate", "routing_drift_rate", "indexer_flip_rate",
                         "indexer_drift_rate"]


@pytest.fixture
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the trainer backend sets the process's threads


def test_all_minus_one_traces_report_null_flip_rates_and_n_a(tmp_path, _restore_threads):
    checkpoint = write_initial_checkpoint(build_config({}), tmp_path / "ckpt")
    actor = TrainerActor(str(checkpoint), TrainerConfig().to_dict(), n_samples_per_prompt=2,
                         engines=[], rollout_batch_size=1, vocab_tokens=list(VOCABULARY))
    cfg = actor.backend.model_config
    prompt, response = np.array([1, 10, 20, 30], np.int32), np.array([5, 6, 7], np.int32)
    rows = len(prompt) + len(response) - 1
    sample = Sample(sample_id=4, group_id=0, rollout_id=0, policy_version=0, prompt_ids=prompt,
                    response_ids=response, loss_mask=np.ones(3, np.uint8),
                    rollout_logprobs=np.zeros(3, np.float32),
                    sample_support=np.stack([response, response], axis=1),
                    routed_experts=np.full((rows, len(cfg.moe_layers), cfg.num_experts_per_tok), -1,
                                           np.int32),
                    indexer_topk=np.full((rows, len(cfg.indexed_layers), cfg.index_topk), -1,
                                         np.int32))
    rates = actor.preflight([sample])
    assert all(math.isnan(v) for k in rates if k.endswith("_rate") for v in rates[k])
    metrics = {"step": 0, "reward_mean": 0.5, "train_rollout_logprob_abs_diff": 0.0,
               "staleness_mean": 0.0, "step_seconds": 0.1, **mean_rates(rates)}
    for name in ("routing_flip_rate", "routing_drift_rate", "indexer_flip_rate",
                 "indexer_drift_rate"):
        assert metrics[name] is None, name
    assert "flips n/a/n/a " in progress_status(metrics)
    with MetricsRecorder(tmp_path / "run", num_steps=1, show_progress=False) as recorder:
        recorder.record(metrics)
    row = strict_json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert row["routing_flip_rate"] is None and row["indexer_flip_rate"] is None
