"""Where a run's checkpoints are on disk: ``<save_dir>/step-N`` folders, each complete once it
holds its :data:`RUN_STATE_FILE` (written last, then the ``.partial`` folder is renamed;
``train_loop.save_checkpoint``).

A module of its own because both the settings check (``config.py``, which names the latest
checkpoint when ``--load`` points at the folder above them) and the loop that writes them read
this layout, and the loop already imports the settings.
"""
from __future__ import annotations

from pathlib import Path

RUN_STATE_FILE = "run_state.json"
"""The file a complete checkpoint holds: the loop's own state (next step, clock, data source)."""


def latest_checkpoint(save_dir: Path) -> Path | None:
    """The complete checkpoint of the most steps under ``save_dir`` (``step-N`` directories
    holding a :data:`RUN_STATE_FILE`; a ``.partial`` one, killed while written, never; steps
    compared as numbers), or ``None`` when there is none, or no such directory."""
    found = []
    for child in Path(save_dir).glob("step-*"):
        number = child.name.removeprefix("step-")
        if number.isdigit() and (child / RUN_STATE_FILE).is_file():
            found.append((int(number), child))
    return max(found)[1] if found else None
