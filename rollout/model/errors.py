"""Typed errors of the embedded model (replayrl.rollout.model).

Every error raised on bad input by this package derives from `ModelError`, so a caller can
catch the whole family; the message names the offending field, key or shape. `ModelError` is a
`replayrl.rollout.errors.RolloutError`: the model is the rollout layer's sub-room that the
trainer may use too (docs/design/layout.md#layout), so its errors stay in this module.
"""
from __future__ import annotations

from replayrl.rollout.errors import RolloutError


class ModelError(RolloutError):
    """Base class of all errors raised by `replayrl.rollout.model`."""


class ModelConfigError(ModelError, ValueError):
    """A `ModelConfig` field (or a Hugging Face config.json entry) is missing or invalid."""


class ModelInputError(ModelError, ValueError):
    """A forward input (ids, positions, padding mask, cache, replay trace) is malformed."""


class CheckpointError(ModelError):
    """A checkpoint directory or weight push does not match the model.

    The message names the missing / unexpected key, or the key with its expected and found shape.
    """
