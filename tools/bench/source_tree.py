"""Run another checkout of replayrl without installing it (``replayrl bench steps`` compares two).

The repository's top-level folders are installed under the ``replayrl`` namespace
(``pyproject.toml`` ``package-dir``), so a bare checkout on ``PYTHONPATH`` does not import as
``replayrl.*``. :func:`importable` builds a folder whose ``replayrl/`` holds one symlink per
layer into the checkout; put it first on ``PYTHONPATH`` and that checkout's modules win over the
installed ones (``replayrl`` is an implicit namespace package: the first portion on the path
that holds ``replayrl/<layer>`` serves it).
"""
from __future__ import annotations

from pathlib import Path

LAYERS = ("transport", "actors", "rollout", "trainer", "tools")


def importable(tree: Path, into: Path) -> Path:
    """Make ``into/replayrl/<layer>`` symlinks to ``tree/<layer>`` and return ``into``.

    Args:
        tree: a replayrl checkout (the repository root).
        into: an empty or missing folder to put on ``PYTHONPATH``.

    Raises:
        FileNotFoundError: ``tree`` lacks one of the layers.
    """
    namespace = into / "replayrl"
    namespace.mkdir(parents=True, exist_ok=True)
    for layer in LAYERS:
        source = (tree / layer).resolve()
        if not (source / "__init__.py").is_file():
            raise FileNotFoundError(f"{tree} is not a replayrl checkout: no {layer}/__init__.py")
        link = namespace / layer
        if not link.is_symlink():
            link.symlink_to(source, target_is_directory=True)
    return into
