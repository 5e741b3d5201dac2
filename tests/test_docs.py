"""The repository carries its own design: source files cite ``docs/design.md`` only.

Checks every ``*.py`` file under actors/, transport/, rollout/, trainer/, tools/ and tests/:

(a) a file mentions the design document only as ``docs/design.md`` (never an out-of-tree
    design file), and no docstring or comment holds an absolute path of a build machine (the
    work or home directory of the machine it was written on), which a fresh clone lacks;
(b) every citation ``docs/design.md §N "Title"`` or ``docs/design.md``, ``"Title"`` names a section
    of docs/design.md with exactly that number and title (``## N. Title`` headings). A title may
    wrap onto the next docstring or comment line.

The checker is a pure function of file text (:func:`check_source`) so that the second half of
this file can prove it on small hand-written examples.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs/design.md"
PACKAGES = ("actors", "transport", "rollout", "trainer", "tools", "tests")

SECTIONS = {
    1: "Layout",
    2: "Trace arrays",
    3: "Sample contract",
    4: "Transport contract",
    5: "Actor contract",
    6: "Version clock",
    7: "Trainer math",
    8: "Rejection sampling",
    9: "Exact refill",
    10: "Engines",
    11: "Trainer backends",
    12: "Parallel pieces",
    13: "Embedded default",
    14: "Hugging Face checkpoints",
    15: "Prompt data, tokenizer and rewards",
    16: "The megatron-core backend",
    17: "SGLang engine",
    18: "Engine fault tolerance",
    19: "Trainer ranks",
    20: "Shared-memory array transport",
    21: "REPL attach and multi-host runs",
    22: "Pipeline parallelism in the megatron backend",
    23: "Context parallelism in the megatron backend",
    24: "Errors",
}

_HEADING = re.compile(r"^## (\d+)\. (\S.*?)\s*$", re.MULTILINE)
# Any mention of a design document (any case), with the path characters in front of it.
_MENTION = re.compile(r"[\w./-]*design\.md", re.IGNORECASE)
# A citation: docs/design.md, then "§N", ", §N", ', "Title"' or '§N "Title"'. The title may
# span a line break (docstrings wrap; a comment continues after "#").
_CITATION = re.compile(
    r'docs/design\.md'
    r'(?:,?[ \t]*§[ \t]*(?P<num>\d+))?'
    r'(?:,?\s*"(?P<title>[A-Za-z][\w /-]*(?:\n[ \t]*#?[ \t]*[\w /-]+)?)")?'
)
# Roots of build machines' file trees; /proc, /dev and /sys are interfaces, not machines.
_ABSOLUTE = re.compile(
    r"(?<![\w:/.~-])/(?:work|home|Users|root|mnt|scratch|opt|srv|private|nfs|data)/")


def design_sections(text: str) -> dict[int, str]:
    """``{number: title}`` of the ``## N. Title`` headings of a design document."""
    return {int(m.group(1)): m.group(2) for m in _HEADING.finditer(text)}


def _docstrings_and_comments(text: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every docstring and comment (a file that does not parse: whole text)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return [(1, text)]
    found = []
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                        and isinstance(stmt.value.value, str)):
                    found.append((stmt.lineno, stmt.value.value))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
    return found


def check_source(name: str, text: str, sections: dict[int, str]) -> list[str]:
    """Problems of one source file, each ``"<name>:<line>: <problem>"``; empty when clean."""
    problems = []

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    for m in _MENTION.finditer(text):
        if m.group(0) != "docs/design.md":
            problems.append(f"{name}:{line_of(m.start())}: cites {m.group(0)!r}; the design is "
                            "docs/design.md (cite it as docs/design.md §N \"Title\")")
    for line, chunk in _docstrings_and_comments(text):
        for m in _ABSOLUTE.finditer(chunk):
            problems.append(f"{name}:{line + chunk.count(chr(10), 0, m.start())}: absolute path "
                            f"{chunk[m.start():m.start() + 40].split()[0]!r} in a docstring or "
                            "comment")
    for m in _CITATION.finditer(text):
        where = f"{name}:{line_of(m.start())}"
        num = int(m.group("num")) if m.group("num") else None
        title = None
        if m.group("title"):
            title = " ".join(re.sub(r"\n[ \t]*#?", " ", m.group("title")).split())
        if num is not None and num not in sections:
            problems.append(f"{where}: cites §{num}, which docs/design.md does not have")
        elif num is not None and title is not None and sections[num] != title:
            problems.append(f"{where}: cites §{num} {title!r}, but §{num} is {sections[num]!r}")
        elif num is None and title is not None and title not in sections.values():
            problems.append(f"{where}: cites section {title!r}, which docs/design.md does not have")
    return problems


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


# -- the repository --------------------------------------------------------------------------

def test_design_has_the_numbered_sections():
    assert design_sections(DESIGN.read_text(encoding="utf-8")) == SECTIONS


def test_sources_cite_only_existing_sections_of_docs_design():
    sections = design_sections(DESIGN.read_text(encoding="utf-8"))
    files = _sources()
    assert len(files) > 50  # the scan really walks the packages
    problems = [p for f in files
                for p in check_source(str(f.relative_to(ROOT)), f.read_text(encoding="utf-8"),
                                      sections)]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


# -- the checker, on hand-written examples ---------------------------------------------------

# Spelt in pieces so that this file does not trip its own repository check.
OLD = "DESIGN" + ".md"
DOC = "docs/desi" + "gn.md"
CAPS = "docs/Desi" + "gn.md"
WORK, HOME = "/" + "work/", "/" + "home/"
SMALL = {3: "Sample contract", 7: "Trainer math"}


def _check(text: str) -> list[str]:
    return check_source("x.py", text, SMALL)


def test_design_sections_reads_numbered_headings_only():
    text = "# replayrl design\n\n## 1. Layout\ntext\n## 12. Parallel pieces  \n### 2. Not a section\n"
    assert design_sections(text) == {1: "Layout", 12: "Parallel pieces"}


@pytest.mark.parametrize("text", [
    f'"""Shapes ({DOC} §3 "Sample contract")."""\n',
    f'"""Shapes ({DOC}, "Sample contract")."""\n',
    f'"""See {DOC} §7 for the formulas."""\n',
    f'"""See {DOC}."""\n',
    f'"""Shapes ({DOC} §3 "Sample\n    contract")."""\n',
    f'x = 1  # {DOC} §7 "Trainer\n# math"\n',
    f'path = "{WORK}data/x"  # a string literal is not a docstring\n',
    '"""Peak memory from /proc/self/status."""\n',
])
def test_checker_accepts(text):
    assert _check(text) == []


@pytest.mark.parametrize("text, expected", [
    (f'"""Rules ({OLD}, "Actor contract")."""\n', [f"x.py:1: cites '{OLD}'"]),
    (f'"""See {WORK}shared/{OLD}."""\n',
     [f"cites '{WORK}shared/{OLD}'", f"absolute path '{WORK}shared/{OLD}.'"]),
    (f'"""See {CAPS} §3."""\n', [f"cites '{CAPS}'"]),
    (f'"""Shapes ({DOC} §4 "Sample contract")."""\n', ["cites §4, which"]),
    (f'"""Shapes ({DOC} §3 "Trainer math")."""\n', ["but §3 is 'Sample contract'"]),
    (f'"""Shapes ({DOC}, "Sample Contract")."""\n', ["section 'Sample Contract'"]),
    (f'"""Appended EOS ({DOC}, "synthetic EOS")."""\n', ["section 'synthetic EOS'"]),
    (f'"""Shapes ({DOC} §3 "Sample\n    context")."""\n', ["§3 'Sample context'"]),
    (f'"""Loaded from {HOME}alice/ckpt."""\n', [f"absolute path '{HOME}alice/ckpt.'"]),
    (f'def f():\n    pass  # written on {WORK}main\n', [f"x.py:2: absolute path '{WORK}main'"]),
])
def test_checker_rejects(text, expected):
    problems = _check(text)
    assert len(problems) == len(expected), problems
    for want, got in zip(expected, problems):
        assert want in got, problems
