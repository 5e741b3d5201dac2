"""The architecture picture (docs/architecture.svg) is the rendering of its source as it is now.

docs/render_architecture.py renders docs/architecture.dot with Graphviz and writes the source's
sha256 into the SVG; these tests compare that record with the source's hash, so a picture left
behind an edit of its source fails here, without Graphviz in CI. They also hold the places that
show the picture (README.md and docs/architecture.md) and the module paths the picture names.
"""
from __future__ import annotations

import importlib.util
import re

from tests.paths import REPO

DOCS = REPO / "docs"
SOURCE, PICTURE = DOCS / "architecture.dot", DOCS / "architecture.svg"


def load_renderer():
    """docs/render_architecture.py as a module (docs/ is no package; it imports stdlib only)."""
    spec = importlib.util.spec_from_file_location("render_architecture", DOCS / "render_architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = load_renderer()


def test_picture_records_the_current_source_hash():
    recorded = render.recorded_sha256(PICTURE.read_text(encoding="utf-8"))
    current = render.source_sha256(SOURCE.read_bytes())
    assert recorded == current, (
        f"docs/architecture.svg was rendered from another docs/architecture.dot (it records "
        f"source-sha256 {recorded}, the source's is {current}): regenerate it with "
        f"`{render.COMMAND}` (needs Graphviz's dot: apt-get install graphviz) and commit both")


def test_readme_and_architecture_page_embed_the_picture():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    assert re.search(r"!\[[^\]]+\]\(docs/architecture\.svg\)", readme), \
        "README.md shows no ![...](docs/architecture.svg)"
    assert re.search(r"!\[[^\]]+\]\(architecture\.svg\)", page), \
        "docs/architecture.md shows no ![...](architecture.svg)"
    for name, text in (("docs/architecture.md", page), ("docs/architecture.dot", SOURCE.read_text())):
        assert render.COMMAND in text, f"{name} does not say how to regenerate the picture ({render.COMMAND})"


def test_the_paths_the_picture_names_exist():
    """A module or room moved or renamed must be renamed in the picture too."""
    text = SOURCE.read_text(encoding="utf-8")
    named = set(re.findall(r"\b(?:tools|rollout|trainer|actors|transport)/[\w/]*(?:\.py|/)", text))
    assert len(named) > 5, named
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, (f"docs/architecture.dot names {missing}, which do not exist; edit it and "
                         f"run `{render.COMMAND}`")


def test_hash_record_round_trip():
    digest = render.source_sha256(b"digraph g {\r\n  a -> b;\r\n}\r\n")
    assert digest == render.source_sha256(b"digraph g {\n  a -> b;\n}\n")  # line endings aside
    svg = f'<?xml version="1.0"?>\n<!-- source-sha256: {digest} (x.dot; regenerate: ...) -->\n<svg/>'
    assert render.recorded_sha256(svg) == digest
    assert render.recorded_sha256('<?xml version="1.0"?>\n<svg/>') is None

