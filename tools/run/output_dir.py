"""An ``--output-dir`` that already holds a run: refused before start, unless the run is resumed
(``--load`` of one of its checkpoints) or replaced (``--overwrite``, whose clearing is here too).

Without the refusal a second ``replayrl train`` into the same directory (``runs/default`` when
none is given) would replace the first run's ``metrics.jsonl`` and leave its checkpoints beside
the new ones, where ``--load`` of the latest would mix the two runs.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.checkpoint_dirs import latest_checkpoint
from replayrl.tools.run.config import RunConfig

RUN_FILES = ("metrics.jsonl", "reward.png", "attach.json")
"""Files of a run in its ``--output-dir`` that ``--overwrite`` removes (the new run writes
``config.json`` again, and ``checkpoint-init`` / ``tokenizer-init`` where it uses them)."""

RUN_DIRS = ("tensorboard", "wandb", "weight-sync")
"""Directories of a run in its ``--output-dir`` that ``--overwrite`` removes."""


def _checkpoints(save_dir: Path) -> list[Path]:
    """The checkpoint directories (``step-N``, ``step-N.partial``) under ``save_dir``."""
    return sorted(p for p in save_dir.glob("step-*") if p.is_dir()) if save_dir.is_dir() else []


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _has_rows(metrics: Path) -> bool:
    """Whether ``metrics`` exists and holds a row: a run stopped before its first step (a
    Ctrl-C during start-up, a refused ``--load``) leaves it empty, and trained nothing."""
    try:
        with metrics.open("rb") as f:
            return any(line.strip() for line in f)
    except OSError:  # none, or --output-dir is no directory (its writability check says so)
        return False


def earlier_run(config: RunConfig) -> list[str]:
    """What of an earlier run ``--output-dir`` holds: a ``metrics.jsonl`` with at least one row
    and / or the checkpoints under ``--save`` (default ``<output-dir>/checkpoints``), as names
    for a message; empty when it holds none."""
    found = []
    if _has_rows(Path(config.output_dir) / "metrics.jsonl"):
        found.append("metrics.jsonl")
    if checkpoints := _checkpoints(Path(config.save_dir)):
        found.append(f"{len(checkpoints)} checkpoint(s) in {config.save_dir}")
    return found


def check_output_dir(config: RunConfig) -> None:
    """Refuse to start a run into an ``--output-dir`` that holds an earlier run
    (:func:`earlier_run`) unless ``--load`` resumes one of its checkpoints (under
    ``--output-dir`` or ``--save``) or ``--overwrite`` replaces it.

    Raises:
        ConfigError: such a directory without either (the message says what to add: the
            ``--load`` of its latest checkpoint, ``--overwrite``, or another ``--output-dir``);
            ``--overwrite`` with ``--load`` of a checkpoint it would delete.
    """
    output, save = Path(config.output_dir), Path(config.save_dir)
    resuming = bool(config.load) and (_inside(Path(config.load), output)
                                      or _inside(Path(config.load), save))
    if config.overwrite:
        if resuming:
            raise ConfigError(f"--overwrite would delete the run in --output-dir {output}, "
                              f"--load {config.load} included; drop --overwrite to resume it")
        return
    found = earlier_run(config)
    if not found or resuming:
        return
    latest = latest_checkpoint(save)
    resume = f"--load {latest} to resume it, " if latest is not None else ""
    raise ConfigError(f"--output-dir {output} already holds a run ({', '.join(found)}); add "
                      f"{resume}--overwrite to replace it, or give another --output-dir")


def clear_run(config: RunConfig) -> list[Path]:
    """``--overwrite``: remove the earlier run's files from ``--output-dir`` (:data:`RUN_FILES`,
    :data:`RUN_DIRS`) and its checkpoints from ``--save``; nothing else there (the directory
    may be the user's own). Returns what was removed. Called once every check passed, so a
    refused run removes nothing."""
    output = Path(config.output_dir)
    gone = [p for p in (*(output / f for f in RUN_FILES), *(output / d for d in RUN_DIRS),
                        *_checkpoints(Path(config.save_dir))) if p.exists()]
    for path in gone:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return gone
