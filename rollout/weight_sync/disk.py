"""The disk weight sync: each push a safetensors file in a directory every engine reads.

The trainer writes ``<directory>/version-<v>/model.safetensors`` (through a ``.partial``
directory renamed when complete, so no engine reads half a push) and sends each engine only
its path. An engine that reads weight files itself (the SGLang client: its servers'
``/update_weights_from_disk``, ``Engine.load_weights_from_disk``) passes the path on; any
other engine reads the file in its own process. The directory must be the same path on every
engine's host (``--weight-sync-dir``); the trainer keeps the last two versions there (one may
still be loading while the next is written).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from replayrl.rollout.errors import WeightSyncError
from replayrl.rollout.weight_sync.base import Packed, WeightHome, WeightSync, manifest

__all__ = ["DiskSync", "WEIGHTS_FILE"]

WEIGHTS_FILE = "model.safetensors"
"""The file of a push inside its version directory."""

_VERSION_DIR = re.compile(r"version-(\d+)")
_KEPT = 2  # versions kept: the one engines may still be loading, and the new one


class DiskSync(WeightSync):
    """Safetensors files in a directory the engines read (``--weight-sync disk``).

    Settings (trainer side): ``directory``, where the pushes are written (created).
    """

    name = "disk"

    def pack(self, tensors: Mapping[str, torch.Tensor], *, version: int,
             home: WeightHome | None = None) -> Packed:
        """See :meth:`WeightSync.pack`: write the push (the tensors copied to the CPU, dtypes
        kept) and drop versions older than the last two.

        Raises:
            WeightSyncError: no ``directory`` setting.
            OSError: the directory is not writable.
        """
        from safetensors.torch import save_file

        if not self.settings.get("directory"):
            raise WeightSyncError("weight sync 'disk' needs its directory (--weight-sync-dir)")
        root = Path(self.settings["directory"])
        path, partial = root / f"version-{version}", root / f"version-{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        # copies: safetensors refuses tensors that share storage, and the weights train on
        cpu = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        save_file(cpu, str(partial / WEIGHTS_FILE))
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)
        versions = sorted(int(m.group(1)) for p in root.iterdir()
                          if (m := _VERSION_DIR.fullmatch(p.name)))
        for old in versions[:-_KEPT]:
            shutil.rmtree(root / f"version-{old}", ignore_errors=True)
        nbytes = sum(t.numel() * t.element_size() for t in cpu.values())
        return Packed(manifest(self.name, path=str(path)), int(nbytes))

    def load(self, engine: Any, received: Any, version: int) -> None:
        """See :meth:`WeightSync.load`: the engine's own file loader when it has one
        (``load_weights_from_disk(path, version=)``), else the file read here.

        Raises:
            WeightSyncError: not a disk manifest.
            replayrl.rollout.model.errors.CheckpointError / OSError: an unreadable file.
        """
        if not isinstance(received, Mapping) or not isinstance(received.get("path"), str):
            raise WeightSyncError(f"weight sync 'disk': expected a manifest with 'path', got "
                                  f"{received!r}"[:300])
        path = received["path"]
        own = getattr(engine, "load_weights_from_disk", None)
        if own is not None:
            own(path, version=version)
            return
        from safetensors.torch import load_file

        engine.load_weights(load_file(str(Path(path) / WEIGHTS_FILE)), version=version)
