"""`read_hf_config`: the `ModelConfig` of a checkpoint's `config.json`, without torch.

The run's settings (`--hf-checkpoint`) read it in processes that never build the model;
`replayrl.rollout.model.loader` (weights, torch) re-exports it.
"""

from __future__ import annotations

import json
from pathlib import Path

from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.errors import CheckpointError
from replayrl.rollout.model.families import is_family


def read_hf_config(directory: str | Path) -> ModelConfig:
    """The `ModelConfig` of a checkpoint directory's `config.json` (a
    `replayrl.rollout.model.families.base.FamilyConfig` for a `model_type` of the family room).

    Raises `CheckpointError` naming the file when it cannot be read or parsed;
    `ModelConfigError` naming the field for an architecture or value the model does not implement,
    or for a non-finite number (`1e400`, which `json` reads as inf, `NaN`, `Infinity`).
    """
    path = Path(directory) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: top level must be an object")
    if is_family(hf.get("model_type")):  # the family room (rollout/model/families/)
        from replayrl.rollout.model.families.base import FamilyConfig

        return FamilyConfig.from_hf_dict(hf)
    return ModelConfig.from_hf_dict(hf)
