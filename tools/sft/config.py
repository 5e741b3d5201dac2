"""The settings of ``replayrl sft``: :class:`SFTConfig` and its flags.

Its own settings are declared once on their field (:func:`replayrl.actors.settings.setting`);
the ones it shares with ``replayrl train`` -- the checkpoint, ``--save-hf``, checkpoints and
resume, the progress display, and the trainer's optimizer, backend, LoRA, device and seed --
are that command's flags (:data:`replayrl.tools.run.flags.FLAGS`, declared on
:class:`replayrl.tools.run.config.RunConfig` / :class:`replayrl.trainer.config.TrainerConfig`),
so a flag means the same in both commands.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from replayrl.actors.settings import Range, check_settings, setting
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.flags import FLAGS, Flag, add_flags, collect_flags
from replayrl.trainer.config import TrainerConfig

SFT_BACKENDS = ("torch", "fsdp")
"""The trainer backends ``replayrl sft`` trains with, in its own process (one rank)."""


@dataclass(frozen=True)
class SFTConfig:
    """Everything ``replayrl sft`` needs.

    Attributes:
        data: the conversation files (JSONL or Parquet, rows with ``messages``).
        num_steps, batch_size: optimizer steps, each over ``batch_size`` conversations drawn
            in a seeded order that is reshuffled on every pass over the data.
        max_length: the most tokens of one rendered conversation.
        skip_bad_rows: skip (count and name) the rows that cannot be trained on instead of
            refusing the data.
        output_dir: ``metrics.jsonl``, ``loss.png``, ``config.json`` and, by default, the
            checkpoints.
        hf_checkpoint, save_hf, save_dir, save_interval, load, progress: as ``replayrl train``'s
            (:class:`replayrl.tools.run.config.RunConfig`); ``hf_checkpoint`` is required.
        trainer: the optimizer, backend, LoRA, device, seed and microbatch settings; the
            replays are off (a conversation has no traces) and the logprobs are at
            temperature 1.

    Raises:
        ConfigError: a setting out of range, no ``--data`` or ``--hf-checkpoint``, or a
            backend other than :data:`SFT_BACKENDS` (each names the flag).
    """

    data: tuple[str, ...] = setting((), "data", "a conversation file: JSONL or Parquet rows "
                                    "with 'messages' in TRL's conversational format (docs/sft.md)",
                                    metavar="FILE")
    num_steps: int = setting(100, "num-steps", "optimizer steps, each over --batch-size "
                             "conversations (the order reshuffled on every pass over the data)",
                             Range(low=1))
    batch_size: int = setting(8, "batch-size", "conversations per optimizer step", Range(low=1))
    max_length: int = setting(1024, "max-length", "the most tokens of one rendered conversation, "
                              "at most the model's max_position_embeddings (longer rows are bad "
                              "rows)", Range(low=2))
    skip_bad_rows: bool = setting(False, "skip-bad-rows", "skip the rows that cannot be trained "
                                  "on (no assistant message, an unknown role, longer than "
                                  "--max-length, ...), naming and counting each, instead of "
                                  "refusing the data")
    output_dir: str = setting("runs/sft", "output-dir", "metrics, plot and checkpoint directory")
    hf_checkpoint: str = ""
    save_hf: str = ""
    save_dir: str = ""
    save_interval: int = 0
    load: str = ""
    progress: bool = True
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        check_settings(self, ConfigError)
        if not self.data:
            raise ConfigError("--data FILE is required: the conversations to train on")
        if not self.hf_checkpoint:
            raise ConfigError("--hf-checkpoint DIR is required: the policy and its chat template")
        if self.trainer.train_backend not in SFT_BACKENDS:
            raise ConfigError(f"--train-backend {self.trainer.train_backend}: replayrl sft trains "
                              f"with {' or '.join(SFT_BACKENDS)}")
        if not self.save_dir:
            object.__setattr__(self, "save_dir", f"{self.output_dir}/checkpoints")

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (``config.json``)."""
        return dataclasses.asdict(self)


SHARED_FLAGS = ("hf-checkpoint", "save-hf", "save", "save-interval", "load", "progress", "device",
                "seed", "lr", "weight-decay", "adam-eps", "clip-grad", "micro-batch-size",
                "use-packing", "trainer-torch-threads", "train-backend", "lora-rank",
                "lora-alpha", "lora-target-modules")
"""The flags of ``replayrl train`` that ``replayrl sft`` takes, with the same meaning."""


def _sft_flags() -> dict[str, Flag]:
    """:data:`SFT_FLAGS`: SFT's own, then the shared ones aimed at :class:`SFTConfig`'s run-level
    fields and the trainer settings (``--seed`` and ``--device`` set only the trainer's)."""
    own = collect_flags({None: SFTConfig})
    names = {f.name for f in dataclasses.fields(SFTConfig)}
    shared = {}
    for name in SHARED_FLAGS:
        flag = FLAGS[name]
        targets = tuple((section, f) for section, f in flag.targets
                        if section == "trainer" or (section is None and f in names))
        shared[name] = dataclasses.replace(flag, targets=targets)
    return {**own, **shared}


SFT_FLAGS: dict[str, Flag] = _sft_flags()
"""flag name (no dashes) -> :class:`replayrl.tools.run.flags.Flag` of ``replayrl sft``."""

_SFT_TRAINER = {"use_routing_replay": False, "use_indexer_replay": False,
                "use_support_replay": False, "temperature": 1.0}
# a conversation carries no traces to replay, and SFT's cross-entropy is of the logits as they are


def add_sft_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of :data:`SFT_FLAGS` to ``parser``."""
    add_flags(parser, SFT_FLAGS.values())


def build_sft_config(values: dict[str, Any]) -> SFTConfig:
    """An :class:`SFTConfig` from flag name (dashes) -> value, over the defaults.

    Raises:
        ConfigError: an unknown flag, or a value a setting refuses (named).
    """
    run: dict[str, Any] = {}
    trainer: dict[str, Any] = dict(_SFT_TRAINER)
    for key, value in values.items():
        flag = SFT_FLAGS.get(key)
        if flag is None:
            raise ConfigError(f"unknown replayrl sft flag --{key}")
        if flag.setting.repeat:
            value = tuple(value)
        for section, name in flag.targets:
            (trainer if section == "trainer" else run)[name] = value
    try:
        return SFTConfig(trainer=TrainerConfig(**trainer), **run)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def sft_config_from_args(args: argparse.Namespace) -> SFTConfig:
    """The :class:`SFTConfig` of the flags given on the command line (:func:`add_sft_flags`)."""
    return build_sft_config({k.replace("_", "-"): v for k, v in vars(args).items()
                             if k.replace("_", "-") in SFT_FLAGS})


