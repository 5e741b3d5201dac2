"""Reading the torch and fsdp backends' checkpoints, every file checked before a load changes
anything (a load is atomic).

Both write the policy as an HF checkpoint in ``model`` (the base under LoRA, peft's adapter
files in ``adapter``) and beside it a trainer-state file per writer: ``trainer_state.pt`` (the
torch backend) or ``fsdp_state.rank<r>.pt`` (the fsdp backend, which adds the ``layout``
record of :mod:`replayrl.trainer.backends.checkpoint_layout`). Each holds ``optimizer`` (an
optimizer state dict), ``version`` and ``torch_rng``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from replayrl.actors.errors import VersionRegression
from replayrl.rollout.model.errors import CheckpointError
from replayrl.rollout.model.loader import load_pretrained
from replayrl.trainer.backends.checkpoint_layout import CheckpointLayout
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.lora import peft_adapter as lora
from replayrl.trainer.lora.settings import target_modules

__all__ = ["read_policy", "read_trainer_state", "check_version", "check_weights_fit"]


def read_policy(directory: Path, config: TrainerConfig) -> torch.nn.Module:
    """The policy of a checkpoint's ``directory/model`` (CPU, fp32), under ``config``'s LoRA
    with the adapters of ``directory/adapter`` (:func:`replayrl.trainer.lora.peft_adapter.load_into`,
    checked against the run's ``--lora-*`` settings); the global RNG is left as it was.

    Raises:
        replayrl.rollout.model.CheckpointError: unreadable model files. ValueError: adapters
            that do not fit this run's ``--lora-*`` settings.
    """
    with torch.random.fork_rng(devices=[]):  # building the model draws initial weights
        model, _ = load_pretrained(directory / "model", dtype=torch.float32)
        if config.lora_rank:
            lora.load_into(model, directory / lora.ADAPTER_DIR, config.lora_rank, config.lora_alpha,
                           target_modules(config.lora_target_modules), config.seed)
    return model


def read_trainer_state(path: Path, *, layout: bool = False) -> dict:
    """A trainer-state file (``weights_only``: no pickle code runs), checked: ``optimizer`` an
    optimizer state dict, ``version`` an int >= 0, ``torch_rng`` a torch RNG state and, with
    ``layout``, a ``layout`` record (:meth:`CheckpointLayout.from_record`).

    Raises:
        ValueError: unreadable, or a missing / malformed field (names the file and the field).
    """
    try:
        # on the CPU whatever device saved it (the backend moves the state to its own)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, pickle / zip errors, EOFError...
        raise ValueError(f"{path}: unreadable trainer state: {type(exc).__name__}: {exc}") from None
    keys = ("optimizer", "version", "torch_rng", "layout") if layout else ("optimizer", "version",
                                                                          "torch_rng")
    if not isinstance(state, dict) or not set(keys) <= set(state):
        raise ValueError(f"{path}: expected the keys {', '.join(keys)}")
    version = state["version"]
    if type(version) is not int or version < 0:
        raise ValueError(f"{path}: version must be an int >= 0, got {version!r}")
    rng, reference = state["torch_rng"], torch.get_rng_state()
    if not isinstance(rng, torch.Tensor) or rng.dtype != reference.dtype or rng.shape != reference.shape:
        raise ValueError(f"{path}: torch_rng is not a torch RNG state")
    if not isinstance(state["optimizer"], dict) or "state" not in state["optimizer"]:
        raise ValueError(f"{path}: optimizer is not an optimizer state dict")
    if layout:
        CheckpointLayout.from_record(state["layout"], path)
    return state


def check_version(directory: Any, version: int, min_version: int) -> None:
    """Refuse a checkpoint saved at ``version`` below the trainer's ``min_version``.

    Raises:
        replayrl.actors.version_clock.VersionRegression: names both versions.
    """
    if version < min_version:
        raise VersionRegression(f"checkpoint {directory} is at version {version}, behind the "
                                f"trainer's {min_version}; versions never move backwards")


def check_weights_fit(directory: Any, weights: dict, current: dict) -> None:
    """Refuse checkpoint ``weights`` whose tensor names or shapes differ from this policy's
    ``current`` state dict (its whole shapes: a ``DTensor`` reports the full one).

    Raises:
        replayrl.rollout.model.CheckpointError: names the missing / unexpected tensors, or the
            first tensor whose shape differs.
    """
    if set(weights) != set(current):
        missing, extra = sorted(set(current) - set(weights)), sorted(set(weights) - set(current))
        raise CheckpointError(f"{directory}/model: tensors do not match this policy "
                              f"(missing {missing[:4]}, unexpected {extra[:4]})")
    for name, tensor in weights.items():
        if tensor.shape != current[name].shape:
            raise CheckpointError(f"{directory}/model: tensor {name} has shape "
                                  f"{tuple(tensor.shape)}, this policy {tuple(current[name].shape)}")
