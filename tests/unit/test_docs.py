"""The repository carries its own documentation, and its citations and links hold.

Checks:

(a) docs/design.md: every section (``## `` heading) has a stable anchor, an
    ``<a id="<anchor>"></a>`` line, then a blank line, right above it; anchors are unique;
    headings carry no numbers; the anchors code cites today are all still there;
(b) every ``*.py`` file under actors/, transport/, rollout/, trainer/, tools/, tests/ and
    examples/: it mentions the design document only as ``docs/design.md`` (never an out-of-tree
    design file), every ``docs/design.md#<anchor>`` names an anchor of docs/design.md, no numbered
    section citation (section sign and a number) is left, and no docstring or comment holds an
    absolute path of a build machine (which a fresh clone lacks);
(c) README.md, docs/*.md and examples/**/*.md: the same citation rules, and every relative link
    ``[text](path#anchor)`` resolves to an existing file and, into a markdown file, to one of
    its anchors (explicit ``<a id>`` or GitHub's heading slugs);
(d) docs/configuration.md holds exactly the flag table generated from the settings;
(e) the extras `.ci/run` installs are the ones README.md and docs/testing.md name, and the vLLM
    venv's extras are the ones docs/engines.md's recipe installs.

The checkers are pure functions of file text (:func:`design_anchors`, :func:`check_source`,
:func:`check_markdown`) so that the second half of this file can prove them on small
hand-written examples.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from tests.paths import REPO

ROOT = REPO
DESIGN = ROOT / "docs/design.md"
PACKAGES = ("actors", "transport", "rollout", "trainer", "tools", "tests", "examples")
SECT = "\u00a7"  # the section sign, spelt so that this file holds none

# Anchors of docs/design.md that code and docs cite; once given, an anchor is never removed or
# renamed (add a new one beside it instead).
KNOWN_ANCHORS = (
    "layout", "trace-arrays", "sample-contract", "transport-contract", "actor-contract",
    "version-clock", "trainer-math", "rejection-sampling", "exact-refill", "engines",
    "trainer-backends", "parallel-pieces", "embedded-default", "hf-checkpoints", "prompt-data",
    "megatron-backend", "sglang-engine", "engine-faults", "trainer-ranks", "shm-transport",
    "attach-and-multi-host", "pipeline-parallel", "context-parallel", "errors",
)

_ANCHOR_LINE = re.compile(r'^<a id="([A-Za-z0-9_-]+)"></a>$')
_ANY_ID = re.compile(r'<a id="([A-Za-z0-9_-]+)"></a>')
_H2 = re.compile(r"^## (\S.*?)\s*$")
_HEADING = re.compile(r"^(#{1,6}) (\S.*?)\s*#*\s*$")
# Any mention of a design document (any case), with the path characters in front of it.
_MENTION = re.compile(r"[\w./-]*design\.md", re.IGNORECASE)
_CITATION = re.compile(r"docs/design\.md#([A-Za-z0-9_-]+)")
_NUMBERED = re.compile(SECT + r"[ \t]*\d+")
# Roots of build machines' file trees; /proc, /dev and /sys are interfaces, not machines.
_ABSOLUTE = re.compile(
    r"(?<![\w:/.~-])/(?:work|home|Users|root|mnt|scratch|opt|srv|private|nfs|data)/")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _fenced(text: str) -> str:
    """Text with fenced code blocks blanked (line numbers kept)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def design_anchors(text: str) -> tuple[dict[str, str], list[str]]:
    """``({anchor: heading}, problems)`` of a design document: each ``## `` heading must follow
    an ``<a id>`` line and one blank line, carry no number, and have an anchor of its own."""
    anchors: dict[str, str] = {}
    problems = []
    lines = _fenced(text).split("\n")
    for i, line in enumerate(lines):
        m = _H2.match(line)
        if not m:
            continue
        title = m.group(1)
        where = f"docs/design.md:{i + 1}"
        if re.match(r"\d+\.? ", title):
            problems.append(f"{where}: numbered heading {line!r}; headings carry no numbers")
        a = _ANCHOR_LINE.match(lines[i - 2]) if i >= 2 and not lines[i - 1].strip() else None
        if a is None:
            problems.append(f"{where}: heading {line!r} lacks an <a id=\"...\"></a> line and a "
                            "blank line above it")
        elif a.group(1) in anchors:
            problems.append(f"{where}: anchor {a.group(1)!r} used twice")
        else:
            anchors[a.group(1)] = title
    return anchors, problems


def github_slugs(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file: explicit ``<a id>`` and heading slugs
    (lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``, ``-1``.. on repeats)."""
    found = set(_ANY_ID.findall(text))
    seen: dict[str, int] = {}
    for line in _fenced(text).split("\n"):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(2).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


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


def _citation_problems(name: str, text: str, anchors: dict[str, str]) -> list[str]:
    problems = []

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    for m in _MENTION.finditer(text):
        if m.group(0) not in ("docs/design.md", "design.md"):
            problems.append(f"{name}:{line_of(m.start())}: cites {m.group(0)!r}; the design is "
                            "docs/design.md (cite a section as docs/design.md#<anchor>)")
    for m in _CITATION.finditer(text):
        if m.group(1) not in anchors:
            problems.append(f"{name}:{line_of(m.start())}: cites docs/design.md#{m.group(1)}, "
                            "an anchor docs/design.md does not have")
    for m in _NUMBERED.finditer(text):
        problems.append(f"{name}:{line_of(m.start())}: numbered section citation {m.group(0)!r};"
                        " cite docs/design.md#<anchor>")
    return problems


def check_source(name: str, text: str, anchors: dict[str, str]) -> list[str]:
    """Problems of one Python source file, each ``"<name>:<line>: <problem>"``; empty when clean."""
    problems = _citation_problems(name, text, anchors)
    for line, chunk in _docstrings_and_comments(text):
        for m in _ABSOLUTE.finditer(chunk):
            problems.append(f"{name}:{line + chunk.count(chr(10), 0, m.start())}: absolute path "
                            f"{chunk[m.start():m.start() + 40].split()[0]!r} in a docstring or "
                            "comment")
    return problems


def check_markdown(name: str, text: str, anchors: dict[str, str], read) -> list[str]:
    """Problems of one markdown file at repository path ``name``. ``read(path)`` gives the text
    of the repository file at a relative path (``None`` when it does not exist; a directory
    reads as ``""``)."""
    problems = _citation_problems(name, text, anchors)
    body = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), _fenced(text))
    here = Path(name).parent
    for m in _LINK.finditer(body):
        target = m.group(1)
        where = f"{name}:{body.count(chr(10), 0, m.start()) + 1}"
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        rel = Path(name) if not path else Path(_normalise(here / path))
        content = read(rel)
        if content is None:
            problems.append(f"{where}: link {target!r}: no file {str(rel)!r}")
            continue
        if not anchor or rel.suffix != ".md":
            continue
        known = set(anchors) if rel == Path("docs/design.md") else github_slugs(content)
        if anchor not in known:
            problems.append(f"{where}: link {target!r}: {str(rel)!r} has no anchor {anchor!r}")
    return problems


def _normalise(path: Path) -> str:
    parts: list[str] = []
    for p in path.parts:
        if p == "..":
            if not parts:
                return "../" + str(path)  # outside the repository: reads as missing
            parts.pop()
        elif p != ".":
            parts.append(p)
    return "/".join(parts)


def _read(rel: Path) -> str | None:
    path = ROOT / rel
    if path.is_dir():
        return ""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""  # a binary file (a picture) exists; it has no anchors
    except OSError:
        return None


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _markdown() -> list[Path]:
    return sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                   *(ROOT / "examples").rglob("*.md")])


def _anchors() -> dict[str, str]:
    return design_anchors(DESIGN.read_text(encoding="utf-8"))[0]


# -- the repository --------------------------------------------------------------------------

def test_design_sections_have_stable_anchors():
    anchors, problems = design_anchors(DESIGN.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)
    missing = [a for a in KNOWN_ANCHORS if a not in anchors]
    assert not missing, f"docs/design.md lost anchors {missing}: anchors are never removed"


def test_sources_cite_existing_design_anchors():
    anchors = _anchors()
    files = _sources()
    assert len(files) > 50  # the scan really walks the packages
    problems = [p for f in files
                for p in check_source(str(f.relative_to(ROOT)), f.read_text(encoding="utf-8"),
                                      anchors)]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_markdown_links_and_citations_resolve():
    anchors = _anchors()
    files = _markdown()
    assert len(files) > 10
    problems = [p for f in files
                for p in check_markdown(str(f.relative_to(ROOT)), f.read_text(encoding="utf-8"),
                                        anchors, _read)]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_configuration_page_flag_table_is_the_generated_one():
    from replayrl.tools.run.config import FLAGS, flag_table_markdown

    lines = (ROOT / "docs/configuration.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("| flag | default | allowed | meaning |")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    table = "\n".join(lines[start:end]) + "\n"
    assert table == flag_table_markdown(), (
        "docs/configuration.md's flag table is out of date: replace it with the output of "
        "python -m replayrl.tools.run.config")
    assert table.count("\n") == len(FLAGS) + 2


def _extras(spec: str) -> set[str]:
    return {e.strip() for e in spec.split(",") if e.strip()}


def test_ci_installs_the_extras_the_docs_name():
    ci = (ROOT / ".ci/run").read_text(encoding="utf-8")
    installs = re.findall(r"pip install[^\n]*-e '\.\[([\w,-]+)\]'", ci)
    assert len(installs) == 2, installs  # the main environment, then the vLLM venv
    main, venv = (_extras(s) for s in installs)
    for page in ("README.md", "docs/testing.md"):
        text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
        named = [_extras(s) for s in re.findall(r"installing `\.\[([\w,-]+)\]`", text)]
        named += [_extras(s) for s in re.findall(r"then `\.\[([\w,-]+)\]`", text)]
        assert named, f"{page} does not say which extras .ci/run installs"
        assert all(n == main for n in named), f"{page} names {named}; .ci/run installs {main}"
    recipe = re.findall(r"\.venv-vllm/bin/pip install[^\n]*-e '\.\[([\w,-]+)\]'",
                        (ROOT / "docs/engines.md").read_text(encoding="utf-8"))
    assert [_extras(s) for s in recipe] == [venv]


# -- the checkers, on hand-written examples --------------------------------------------------

# Spelt in pieces so that this file does not trip its own repository check.
OLD = "DESIGN" + ".md"
DOC = "docs/desi" + "gn.md"
CAPS = "docs/Desi" + "gn.md"
WORK, HOME = "/" + "work/", "/" + "home/"
SMALL = {"sample-contract": "Sample contract", "trainer-math": "Trainer math"}


def _check(text: str) -> list[str]:
    return check_source("x.py", text, SMALL)


def test_design_anchors_reads_anchor_lines_above_headings():
    text = ('# design\n\n<a id="layout"></a>\n\n## Layout\ntext\n'
            '<a id="par"></a>\n\n## Parallel pieces  \n### A subsection\n')
    assert design_anchors(text) == ({"layout": "Layout", "par": "Parallel pieces"}, [])


@pytest.mark.parametrize("text, expected", [
    ("## Layout\n", ["lacks an <a id"]),
    ('<a id="layout"></a>\n## Layout\n', ["lacks an <a id"]),  # no blank line: HTML block
    ('<a id="a"></a>\n\n## 1. Layout\n', ["numbered heading"]),
    ('<a id="a"></a>\n\n## A\n<a id="a"></a>\n\n## B\n', ["used twice"]),
])
def test_design_anchors_rejects(text, expected):
    problems = design_anchors(text)[1]
    assert len(problems) == len(expected), problems
    for want, got in zip(expected, problems):
        assert want in got, problems


def test_github_slugs():
    text = ('<a id="x"></a>\n# Top\n## Your own prompts (`examples/own_data/`)\n## Top\n'
            "```\n## not a heading\n```\n")
    assert github_slugs(text) == {"x", "top", "your-own-prompts-examplesown_data", "top-1"}


@pytest.mark.parametrize("text", [
    f'"""Shapes ({DOC}#sample-contract)."""\n',
    f'"""See {DOC}#trainer-math for the formulas."""\n',
    f'"""See {DOC}."""\n',
    f'x = 1  # {DOC}#trainer-math\n',
    f'path = "{WORK}data/x"  # a string literal is not a docstring\n',
    '"""Peak memory from /proc/self/status."""\n',
])
def test_checker_accepts(text):
    assert _check(text) == []


@pytest.mark.parametrize("text, expected", [
    (f'"""Rules ({OLD}#actor-contract)."""\n', [f"x.py:1: cites '{OLD}'"]),
    (f'"""See {WORK}shared/{OLD}."""\n',
     [f"cites '{WORK}shared/{OLD}'", f"absolute path '{WORK}shared/{OLD}.'"]),
    (f'"""See {CAPS}#sample-contract."""\n', [f"cites '{CAPS}'"]),
    (f'"""Shapes ({DOC}#sample-contracts)."""\n', ["#sample-contracts, an anchor"]),
    (f'"""Shapes ({DOC} {SECT}3 "Sample contract")."""\n', [f"numbered section citation '{SECT}3'"]),
    (f'# large arrays go through shared memory ({SECT} 20)\n', ["numbered section citation"]),
    (f'"""Loaded from {HOME}alice/ckpt."""\n', [f"absolute path '{HOME}alice/ckpt.'"]),
    (f'def f():\n    pass  # written on {WORK}main\n', [f"x.py:2: absolute path '{WORK}main'"]),
])
def test_checker_rejects(text, expected):
    problems = _check(text)
    assert len(problems) == len(expected), problems
    for want, got in zip(expected, problems):
        assert want in got, problems


FILES = {
    "docs/design.md": '<a id="sample-contract"></a>\n\n## Sample contract\n',
    "docs/launchers.md": "# Launchers\n## Across hosts\n",
    "docs/gpu.md": "",
    "examples/own_data/README.md": "",
}


def _md(name: str, text: str) -> list[str]:
    return check_markdown(name, text, SMALL, lambda rel: FILES.get(str(rel)))


@pytest.mark.parametrize("name, text", [
    ("README.md", "See [the launchers](docs/launchers.md#across-hosts) and [gpu](docs/gpu.md).\n"),
    ("docs/gpu.md", "[Sample contract](design.md#sample-contract), [up](../examples/own_data/README.md)\n"),
    ("docs/design.md", "[Trainer math](#trainer-math)\n"),
    ("docs/gpu.md", "[site](https://example.com/x#y) and `[not](a link)`\n```\n[x](nowhere.md)\n```\n"),
])
def test_markdown_checker_accepts(name, text):
    assert _md(name, text) == []


@pytest.mark.parametrize("name, text, expected", [
    ("README.md", "[x](docs/nowhere.md)\n", ["no file 'docs/nowhere.md'"]),
    ("README.md", "[x](docs/launchers.md#across-host)\n", ["has no anchor 'across-host'"]),
    ("docs/gpu.md", "[x](design.md#layout)\n", ["'docs/design.md' has no anchor 'layout'"]),
    ("docs/gpu.md", f"as {DOC} {SECT}7 says\n", ["numbered section citation"]),
    ("docs/gpu.md", f"see {DOC}#trainer-maths\n", ["an anchor docs/design.md does not have"]),
    ("docs/design.md", "[x](#nowhere)\n", ["has no anchor 'nowhere'"]),
])
def test_markdown_checker_rejects(name, text, expected):
    problems = _md(name, text)
    assert len(problems) == len(expected), problems
    for want, got in zip(expected, problems):
        assert want in got, problems
