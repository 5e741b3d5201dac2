"""Render docs/architecture.dot to docs/architecture.svg, recording the source's sha256 in it.

    python docs/render_architecture.py

Needs Graphviz's ``dot`` on PATH (Debian: ``apt-get install graphviz``); imports only the
standard library, and runs ``dot`` only when called as a script. The SVG gets the comment
``<!-- source-sha256: HEX -->`` right after its XML declaration;
tests/unit/test_architecture_picture.py compares it with :func:`source_sha256` of the .dot
file as it is now, so a picture left behind its source fails the tests without Graphviz in CI.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "architecture.dot"
TARGET = HERE / "architecture.svg"
COMMAND = "python docs/render_architecture.py"
HASH_COMMENT = re.compile(r"<!-- source-sha256: ([0-9a-f]{64}) ")


def source_sha256(source: bytes) -> str:
    """The sha256 of a .dot file's bytes, line endings normalised to ``\\n``."""
    return hashlib.sha256(source.replace(b"\r\n", b"\n")).hexdigest()


def recorded_sha256(svg: str) -> str | None:
    """The source hash an SVG written by :func:`render` records; None when it records none."""
    match = HASH_COMMENT.search(svg)
    return match.group(1) if match else None


def render(source: Path = SOURCE, target: Path = TARGET) -> str:
    """Run ``dot -Tsvg`` on ``source``, write ``target`` with the hash comment; returns the hash.

    Raises:
        FileNotFoundError: no ``dot`` on PATH.
        subprocess.CalledProcessError: ``dot`` rejected the source (its message on stderr).
    """
    data = source.read_bytes()
    digest = source_sha256(data)
    svg = subprocess.run(["dot", "-Tsvg"], input=data, capture_output=True,
                         check=True).stdout.decode("utf-8")
    comment = f"<!-- source-sha256: {digest} ({source.name}; regenerate: {COMMAND}) -->\n"
    head, sep, rest = svg.partition("?>\n")  # after the XML declaration
    svg = head + sep + comment + rest if sep else comment + svg
    target.write_text(svg, encoding="utf-8")
    return digest


if __name__ == "__main__":
    print(f"{TARGET.name}: source-sha256 {render()}")
