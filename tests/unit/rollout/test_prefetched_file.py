"""The prefetched rollout a checkpoint holds: written and read back sample for sample (the
resumed run trains exactly what the interrupted one would have); a damaged file is refused."""
from __future__ import annotations

import numpy as np
import pytest

from replayrl.rollout.dispatch.prefetched import read_prefetched, write_prefetched
from replayrl.rollout.errors import RolloutError
from replayrl.rollout.sample import Sample


def _sample(i: int, response: list[int]) -> Sample:
    R = len(response)
    return Sample(sample_id=10 + i, group_id=i // 2, rollout_id=3, policy_version=2,
                  prompt_ids=np.array([1, 2, 3 + i], np.int32),
                  response_ids=np.array(response, np.int32), loss_mask=np.ones(R, np.uint8),
                  rollout_logprobs=np.linspace(-1.0, -0.1, R, dtype=np.float32) * (i + 1),
                  reward=0.25 * i, status="truncated" if i == 3 else "completed",
                  routed_experts=np.arange((3 + R - 1) * 2 * 2, dtype=np.int32).reshape(-1, 2, 2) % 8)


def test_a_batch_comes_back_field_for_field_with_its_summary(tmp_path):
    samples = [_sample(i, [5, 6, 7][: 1 + i % 3]) for i in range(4)]
    summary = {"rollout_id": 3, "reward_mean": 0.375, "policy_versions": [2],
               "prompt_indices": [7, 1], "generate_seconds": 0.5}
    write_prefetched(tmp_path / "batch", 3, summary, samples)
    rollout_id, back_summary, back = read_prefetched(tmp_path / "batch")
    assert rollout_id == 3 and back_summary == summary
    assert len(back) == 4
    for a, b in zip(samples, back):
        for name in ("sample_id", "group_id", "rollout_id", "policy_version", "reward", "status",
                     "synthetic_eos"):
            assert getattr(a, name) == getattr(b, name)
        for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "routed_experts"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))  # bit for bit
            assert getattr(a, name).dtype == getattr(b, name).dtype
        assert b.sample_support is None and b.indexer_topk is None


def test_a_damaged_or_foreign_file_is_refused_naming_it(tmp_path):
    write_prefetched(tmp_path / "batch", 3, {}, [_sample(0, [5])])
    data = (tmp_path / "batch").read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 2])
    with pytest.raises(RolloutError, match="cut: not a prefetched rollout"):
        read_prefetched(tmp_path / "cut")
    (tmp_path / "other").write_bytes(b"\x81\xa1a\x01")  # msgpack {"a": 1}
    with pytest.raises(RolloutError, match=r"other: not a prefetched rollout \(keys \['a'\]\)"):
        read_prefetched(tmp_path / "other")
