"""Loggers get the frozen config and a read-only view of each step's metrics."""
from __future__ import annotations

import json

import pytest

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import launch
from tests import hook_fixtures


async def test_metrics_hook_sees_every_step_and_cannot_change_anything(tmp_path):
    hook_fixtures.SEEN.clear()
    config = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "num-steps": 2,
                           "progress": False, "output-dir": str(tmp_path),
                           "metrics-hook": ["tests.hook_fixtures:record"]})
    result = await launch(config)
    assert [s["step"] for s in hook_fixtures.SEEN] == [0, 1]
    assert all(s["metrics_read_only"] and s["nested_read_only"] and s["config_frozen"]
               for s in hook_fixtures.SEEN)
    written = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [w["reward_mean"] for w in written] == [s["reward"] for s in hook_fixtures.SEEN]
    assert config.rollout.top_k == 20


async def test_unknown_hook_fails_before_any_process_starts(tmp_path):
    config = build_config({"num-steps": 1, "progress": False, "output-dir": str(tmp_path / "x"),
                           "metrics-hook": ["tests.hook_fixtures:nope"]})
    with pytest.raises(ConfigError, match="--metrics-hook tests.hook_fixtures:nope"):
        await launch(config)
    assert not (tmp_path / "x").exists()


async def test_custom_reward_gets_read_only_inputs_and_sets_the_reward(tmp_path):
    config = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 2, "num-steps": 1,
                           "progress": False, "output-dir": str(tmp_path),
                           "custom-reward": "tests.hook_fixtures:quarter_reward"})
    result = await launch(config)
    assert result.rows[0]["reward_mean"] == 0.25
