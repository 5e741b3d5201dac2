"""Run another checkout of replayrl without installing it (``replayrl bench steps`` compares two).

The repository's top-level folders are installed under the ``replayrl`` namespace
(``pyproject.toml`` ``package-dir``), so a bare checkout on ``PYTHONPATH`` does not import as
``replayrl.*``. :func:`importable` builds a folder whose ``replayrl/`` holds one symlink per
layer into the checkout; put it first on ``PYTHONPATH`` and that checkout's modules win over the
installed ones (``replayrl`` is an implicit namespace package: the first portion on the path
that holds ``replayrl/<layer>`` serves it).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

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


def train_command(tree: Path, output_dir: Path, steps: int, extra: Sequence[str]
                  ) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment)`` of ``replayrl train`` run from checkout ``tree``.

    A checkout from before the ``replayrl`` namespace (no ``replayrl.tools.cli:main`` entry in
    its ``pyproject.toml``) runs as bare top-level packages; a namespaced one through a folder
    of symlinks next to ``output_dir`` (:func:`importable`). ``extra``: flags after the default
    ``--num-steps steps --no-progress --output-dir output_dir``.

    Raises:
        FileNotFoundError: ``tree`` has no ``pyproject.toml`` or lacks a layer.
    """
    if '"replayrl.tools.cli:main"' in (tree / "pyproject.toml").read_text():
        module = "replayrl.tools.cli"
        path = importable(tree, output_dir.parent / f"importable-{output_dir.name}")
    else:
        module, path = "tools.cli", tree
    argv = [sys.executable, "-m", module, "train", "--num-steps", str(steps), "--no-progress",
            "--output-dir", str(output_dir), *extra]
    return argv, {**os.environ, "PYTHONPATH": str(path)}


@contextlib.contextmanager
def checked_out(root: Path, revision: str) -> Iterator[Path]:
    """A temporary ``git worktree`` of ``revision`` of the checkout at ``root``, removed on exit.

    Raises:
        replayrl.tools.errors.BenchError: not a git checkout, or an unknown revision (git's message).
    """
    from replayrl.tools.errors import BenchError  # here: tests/conftest.py loads this file alone

    with tempfile.TemporaryDirectory(prefix="replayrl-baseline-") as tmp:
        tree = Path(tmp) / "baseline"
        made = subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-q",
                               str(tree), revision], capture_output=True, text=True)
        if made.returncode != 0:
            raise BenchError(f"cannot check out {revision!r}: {made.stderr.strip()}")
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)],
                           check=False)
