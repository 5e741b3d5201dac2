"""Checking a Hugging Face checkpoint directory's safetensors files without loading them, and
without torch (the launcher checks ``--hf-checkpoint`` before any process starts; reading is
``replayrl.rollout.model.loader``)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from replayrl.rollout.model.errors import CheckpointError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def check_weight_files(directory: str | Path) -> int:
    """Open every weight file of a checkpoint directory and read its safetensors header (not
    the tensors): what a run checks before any process starts. Returns the tensor count.

    Raises:
        CheckpointError: no model.safetensors / index, an unreadable index, a missing or
            truncated shard, or an index naming a tensor its shard does not hold (named).
    """
    src = Path(directory)
    count = 0
    for path, names in _weight_files(src):
        try:
            with safe_open(str(path), framework="numpy") as f:  # the header only: no torch
                stored = set(f.keys())
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
        absent = sorted(set(names or ()) - stored)
        if absent:
            raise CheckpointError(f"{src / INDEX_NAME} maps {absent[0]!r} to {path.name}, "
                                  f"which does not hold it")
        count += len(stored)
    return count


def weight_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name -> shape in a checkpoint directory, from its safetensors headers
    alone (no tensor is read; no torch).

    Raises:
        CheckpointError: as :func:`check_weight_files`.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for path, _ in _weight_files(Path(directory)):
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    shapes[name] = tuple(int(d) for d in f.get_slice(name).get_shape())
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return shapes


def _weight_files(src: Path) -> list[tuple[Path, list[str] | None]]:
    """(shard path, names the index assigns to it, or None = every tensor of a single file)."""
    index = src / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"cannot read {index}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to files")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(str(file), []).append(name)
        shards = []
        for file, names in sorted(by_file.items()):
            path = src / file
            if Path(file).name != file or not path.is_file():
                raise CheckpointError(f"{index} names the shard {file!r}, which is not a file "
                                      f"in {src}")
            shards.append((path, names))
        return shards
    single = src / WEIGHTS_NAME
    if single.is_file():
        return [(single, None)]
    other = sorted(p.name for p in src.glob("*.bin")) if src.is_dir() else []
    hint = f" (found {', '.join(other)}: only safetensors weights are read)" if other else ""
    raise CheckpointError(f"{src} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}{hint}")
