"""The parallel layout a trainer checkpoint was saved with, and the checks that refuse to
resume it under another (docs/design/megatron.md#megatron-backend).

A megatron checkpoint holds one ``trainer_state.rank<r>.pt`` per rank: each rank's shard of
the optimizer state, cut by the tensor-, pipeline-, context-, expert- and data-parallel layout
of the world that wrote it. Loaded under another layout, the shards either fail in
``load_state_dict`` after every actor started or, worse, load with the wrong shapes and crash at
the first optimizer step; so every rank file records the layout and a resume is checked
against it before any process starts. The torch backend writes one ``trainer_state.pt``
instead, the fsdp backend one ``fsdp_state.rank<r>.pt`` per rank (with the layout record:
its shards are cut by ``--dp-size``); each backend names the writer when handed another's
checkpoint.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import CheckpointLayoutError

__all__ = ["CheckpointLayout", "check_layout", "refuse_other_backend"]

_SIZES = ("tp", "pp", "cp", "ep", "dp")


@dataclass(frozen=True)
class CheckpointLayout:
    """Sizes of the parallel layout of a megatron trainer world (all ints >= 1).

    Attributes:
        tp, pp, cp, ep: tensor-, pipeline-, context- and expert-parallel sizes.
        dp: data-parallel size (megatron's, without the context-parallel ranks).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1

    @classmethod
    def of_config(cls, config: TrainerConfig) -> CheckpointLayout:
        """The layout a run asks for: ``--tp-size --pp-size --cp-size --ep-size --dp-size``."""
        return cls(tp=config.tp_size, pp=config.pp_size, cp=config.cp_size, ep=config.ep_size,
                   dp=config.dp_size)

    @classmethod
    def from_record(cls, record: object, path: Path) -> CheckpointLayout:
        """The layout from a state file's ``layout`` entry (a dict of the five sizes).

        Raises:
            ValueError: not a dict of the five sizes as ints >= 1 (names the file and field).
        """
        if not isinstance(record, dict) or set(record) != set(_SIZES):
            raise ValueError(f"{path}: layout must be a dict with the keys {', '.join(_SIZES)}, "
                             f"got {record!r}")
        for name in _SIZES:
            v = record[name]
            if type(v) is not int or v < 1:
                raise ValueError(f"{path}: layout.{name} must be an int >= 1, got {v!r}")
        return cls(**record)

    def record(self) -> dict[str, int]:
        """The dict saved in every rank's state file."""
        return asdict(self)

    @property
    def ranks(self) -> int:
        """Trainer ranks of the layout: ``dp x tp x pp x cp`` (EP splits these ranks)."""
        return self.dp * self.tp * self.pp * self.cp

    def flags(self) -> str:
        """The layout as the run's flags, e.g. ``--tp-size 2 --pp-size 1 ... --dp-size 1``."""
        return " ".join(f"--{name}-size {getattr(self, name)}" for name in _SIZES)


def check_layout(directory: Path, saved: CheckpointLayout | None, rank_files: int,
                 requested: CheckpointLayout, files: str = "trainer_state.rank<r>.pt") -> None:
    """Refuse to load a megatron checkpoint under a layout other than the one it was saved
    with. ``saved`` None is a checkpoint from before layouts were recorded: accepted only
    when its ``rank_files`` count equals ``requested.ranks`` (its layout cannot be told
    apart further). ``files`` names the rank files in the messages.

    Raises:
        CheckpointLayoutError: the layouts differ (names the saved and the requested flags and
            the way out: the same layout, or the checkpoint's HF weights as a fresh start).
    """
    fresh = (f"the optimizer state is sharded by layout (load with the same layout, or take "
             f"its HF model/ weights with --hf-checkpoint {directory / 'model'} to start fresh)")
    if saved is None:
        if rank_files != requested.ranks:
            raise CheckpointLayoutError(
                f"checkpoint {directory} records no parallel layout and has {rank_files} "
                f"{files} file(s); this run asks for {requested.flags()} "
                f"({requested.ranks} trainer rank(s)); {fresh}")
        return
    if saved != requested:
        raise CheckpointLayoutError(
            f"checkpoint {directory} was saved with {saved.flags()}; this run asks for "
            f"{requested.flags()}; {fresh}")
    if rank_files != saved.ranks:
        raise CheckpointLayoutError(f"checkpoint {directory} was saved with {saved.flags()} "
                                    f"({saved.ranks} ranks) but holds {rank_files} "
                                    f"{files} file(s); it is incomplete")


_STATE_FILES = {"torch": "trainer_state.pt", "megatron": "trainer_state.rank*.pt",
                "fsdp": "fsdp_state.rank*.pt"}
"""Backend name -> the glob of the trainer state file(s) its checkpoints hold."""


def refuse_other_backend(directory: Path, backend: str) -> None:
    """Name the backend that wrote ``directory`` when it is not ``backend`` ("torch": one
    ``trainer_state.pt``; "megatron": ``trainer_state.rank<r>.pt`` per rank; "fsdp":
    ``fsdp_state.rank<r>.pt`` per rank).

    Raises:
        CheckpointLayoutError: ``directory`` holds another backend's state files only.
    """
    directory = Path(directory)
    writers = [name for name, pattern in _STATE_FILES.items() if any(directory.glob(pattern))]
    if writers and backend not in writers:
        other = writers[0]
        raise CheckpointLayoutError(
            f"checkpoint {directory} was written by --train-backend {other}, this run uses "
            f"--train-backend {backend}; resume it with --train-backend {other}, or take its HF "
            f"model/ weights with --hf-checkpoint {directory / 'model'} to start fresh")
