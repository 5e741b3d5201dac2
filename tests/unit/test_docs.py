"""The repository carries its own documentation, and its citations and links hold.

Checks:

(a) the design, docs/design/*.md (one page per subject, docs/design/README.md the index): every
    section (``## `` heading) has a stable anchor, an ``<a id="<anchor>"></a>`` line, then a
    blank line, right above it; anchors are unique across all the pages; headings carry no
    numbers; every page is shorter than ``MAX_DESIGN_PAGE_LINES`` and linked from the index;
    the anchors code cites today are all still there, on some page;
(b) every ``*.py`` file under actors/, transport/, rollout/, trainer/, tools/, tests/ and
    examples/, pyproject.toml and the files of .ci/: it mentions the design only as
    ``docs/design/<page>.md`` of an existing page (never the single file the design once was,
    nor an out-of-tree design file), every ``docs/design/<page>.md#<anchor>`` names an anchor
    of that page, no numbered section citation (section sign and a number) is left, and no
    docstring or comment of a ``*.py`` file holds an absolute path of a build machine (which a
    fresh clone lacks);
(c) README.md, docs/*.md, docs/design/*.md and examples/**/*.md: the same citation rules, and
    every relative link ``[text](path#anchor)`` resolves to an existing file and, into a
    markdown file, to one of its anchors (into a design page: its explicit ``<a id>``; else
    explicit ``<a id>`` or GitHub's heading slugs);
(d) docs/configuration.md holds exactly the flag table generated from the settings;
(e) the extras `.ci/run` installs are the ones README.md and docs/testing.md name, and the vLLM
    venv's extras are the ones docs/engines.md's recipe installs;
(f) no tracked ``*.py``, ``*.md`` or ``*.toml`` file carries a work-log label (a numbered cut
    or issue of this project's own work list): code and docs say why in terms of the code and
    link a docs anchor where there is a measurement. An external project's issue is cited as
    ``owner/repo#N`` or by its URL, which this check leaves alone.
(g) docs/benchmarks.md, the newest measurement of each figure, stays within
    ``MAX_BENCHMARKS_LINES`` lines.

The checkers are pure functions of file text (:func:`design_anchors`, :func:`design_pages`,
:func:`check_source`, :func:`check_markdown`, :func:`work_log_labels`) so that the second half
of this file can prove them on small hand-written examples.
"""
from __future__ import annotations

import ast
import fnmatch
import io
import os
import re
import tokenize
from pathlib import Path

import pytest

from tests.paths import REPO

ROOT = REPO
DESIGN_DIR = "docs/design"
DESIGN_INDEX = "docs/design/README.md"
# A design page is read at once; a subject that outgrows this splits into two pages (its
# sections keep their anchors, citations follow them to the new page).
MAX_DESIGN_PAGE_LINES = 400
# docs/benchmarks.md holds the newest measurement of each figure, read in minutes; a rerun
# replaces its row, and earlier runs stay in git history, so the page never grows into a diary.
MAX_BENCHMARKS_LINES = 500
PACKAGES = ("actors", "transport", "rollout", "trainer", "tools", "tests", "examples")
SECT = "\u00a7"  # the section sign, spelt so that this file holds none

# Anchors of the design pages that code and docs cite; once given, an anchor is never removed or
# renamed (add a new one beside it instead); a section may move to another page with its anchor.
KNOWN_ANCHORS = (
    "layout", "trace-arrays", "sample-contract", "transport-contract", "actor-contract",
    "colocate", "version-clock", "trainer-math", "entropy-collapse", "rejection-sampling",
    "exact-refill", "engines", "trainer-backends", "lora", "parallel-pieces", "embedded-default",
    "hf-checkpoints", "prompt-data", "sort-task", "megatron-backend", "sglang-engine",
    "engine-faults", "trainer-ranks", "shm-transport", "attach-and-multi-host",
    "pipeline-parallel", "context-parallel", "errors",
)

_ANCHOR_LINE = re.compile(r'^<a id="([A-Za-z0-9_-]+)"></a>$')
_ANY_ID = re.compile(r'<a id="([A-Za-z0-9_-]+)"></a>')
_H2 = re.compile(r"^## (\S.*?)\s*$")
_HEADING = re.compile(r"^(#{1,6}) (\S.*?)\s*#*\s*$")
# Any mention of a design document (any case), with the path characters in front of it: the
# single file the design once was, or a page.
_MENTION = re.compile(r"[\w./-]*design(?:/[\w.-]*)?\.md", re.IGNORECASE)
# The two forms a mention may take: from the repository root, or from a page in docs/.
_PAGE_MENTION = re.compile(r"(?:docs/)?(design/[A-Za-z0-9_-]+\.md)")
_CITATION = re.compile(r"docs/design/([A-Za-z0-9_-]+\.md)#([A-Za-z0-9_-]+)")
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


def design_anchors(text: str, name: str = DESIGN_DIR + "/<page>.md") -> tuple[dict[str, str], list[str]]:
    """``({anchor: heading}, problems)`` of one design page: each ``## `` heading must follow
    an ``<a id>`` line and one blank line, carry no number, and have an anchor of its own."""
    anchors: dict[str, str] = {}
    problems = []
    lines = _fenced(text).split("\n")
    for i, line in enumerate(lines):
        m = _H2.match(line)
        if not m:
            continue
        title = m.group(1)
        where = f"{name}:{i + 1}"
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


def design_pages(pages: dict[str, str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """``({page: {anchor: heading}}, problems)`` of the design pages ``{repository path: text}``
    (the index, ``DESIGN_INDEX``, among them): each page's own problems
    (:func:`design_anchors`), an anchor on two pages, a page of ``MAX_DESIGN_PAGE_LINES`` lines
    or more, a page the index does not link."""
    found: dict[str, dict[str, str]] = {}
    problems = []
    home: dict[str, str] = {}
    for name, text in sorted(pages.items()):
        anchors, own = design_anchors(text, name)
        problems += own
        for a in anchors:
            if a in home:
                problems.append(f"{name}: anchor {a!r} is also on {home[a]}; anchors are unique "
                                "across the design pages")
            else:
                home[a] = name
        found[name] = anchors
        n = text.count("\n") + (not text.endswith("\n"))
        if n >= MAX_DESIGN_PAGE_LINES:
            problems.append(f"{name}: {n} lines; a design page stays under "
                            f"{MAX_DESIGN_PAGE_LINES} (split the subject into two pages)")
    index = pages.get(DESIGN_INDEX)
    if index is None:
        problems.append(f"{DESIGN_INDEX}: missing; the design's index lists every page")
    else:
        linked = {_normalise(Path(DESIGN_DIR) / m.group(1).partition("#")[0])
                  for m in _LINK.finditer(_fenced(index))}
        for name in sorted(pages):
            if name != DESIGN_INDEX and name not in linked:
                problems.append(f"{DESIGN_INDEX}: does not link {name}; the index lists every "
                                "page")
    return found, problems


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


Pages = dict[str, dict[str, str]]  # {"docs/design/<page>.md": {anchor: heading}}


def _page_of(pages: Pages, anchor: str) -> str | None:
    return next((p for p, anchors in pages.items() if anchor in anchors), None)


def _citation_problems(name: str, text: str, pages: Pages) -> list[str]:
    problems = []

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    for m in _MENTION.finditer(text):
        form = _PAGE_MENTION.fullmatch(m.group(0))
        if form is None:
            problems.append(f"{name}:{line_of(m.start())}: cites {m.group(0)!r}; the design is "
                            "docs/design/ (cite a section as docs/design/<page>.md#<anchor>, the "
                            "whole design as docs/design/README.md)")
        elif f"docs/{form.group(1)}" not in pages:
            problems.append(f"{name}:{line_of(m.start())}: cites {m.group(0)!r}, a design page "
                            "that does not exist")
    for m in _CITATION.finditer(text):
        page, anchor = f"{DESIGN_DIR}/{m.group(1)}", m.group(2)
        if page in pages and anchor not in pages[page]:
            elsewhere = _page_of(pages, anchor)
            hint = f"; it is on {elsewhere}" if elsewhere else ""
            problems.append(f"{name}:{line_of(m.start())}: cites {page}#{anchor}, an anchor "
                            f"{page} does not have{hint}")
    for m in _NUMBERED.finditer(text):
        problems.append(f"{name}:{line_of(m.start())}: numbered section citation {m.group(0)!r};"
                        " cite docs/design/<page>.md#<anchor>")
    return problems


def check_citations(name: str, text: str, pages: Pages) -> list[str]:
    """Citation problems of a file that is neither Python nor markdown (pyproject.toml, .ci/)."""
    return _citation_problems(name, text, pages)


def check_source(name: str, text: str, pages: Pages) -> list[str]:
    """Problems of one Python source file, each ``"<name>:<line>: <problem>"``; empty when clean."""
    problems = _citation_problems(name, text, pages)
    for line, chunk in _docstrings_and_comments(text):
        for m in _ABSOLUTE.finditer(chunk):
            problems.append(f"{name}:{line + chunk.count(chr(10), 0, m.start())}: absolute path "
                            f"{chunk[m.start():m.start() + 40].split()[0]!r} in a docstring or "
                            "comment")
    return problems


def check_markdown(name: str, text: str, pages: Pages, read) -> list[str]:
    """Problems of one markdown file at repository path ``name``. ``read(path)`` gives the text
    of the repository file at a relative path (``None`` when it does not exist; a directory
    reads as ``""``)."""
    problems = _citation_problems(name, text, pages)
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
        known = set(pages[str(rel)]) if str(rel) in pages else github_slugs(content)
        if anchor not in known:
            elsewhere = _page_of(pages, anchor) if str(rel) in pages else None
            hint = f" (it is on {elsewhere})" if elsewhere else ""
            problems.append(f"{where}: link {target!r}: {str(rel)!r} has no anchor "
                            f"{anchor!r}{hint}")
    return problems


# A label of this project's own work list: "cut (N)" / "cuts (N)-(M)", "issue N" / "issue #N"
# (any case). An external project's issue, cited as owner/repo#N or its URL (.../issues/N), is
# not one.
_WORK_LOG = re.compile(r"\b(?:cuts?[ \t]*\(\d+\)|issues?[ \t]+#?\d+)", re.IGNORECASE)


def work_log_labels(name: str, text: str) -> list[str]:
    """``"<name>:<line>: ..."`` for every work-log label in a file's text."""
    return [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: work-log label {m.group(0)!r}; "
            "say why in terms of the code, and link a docs anchor where there is a measurement"
            for m in _WORK_LOG.finditer(text)]


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


def _other_citing_files() -> list[Path]:
    return sorted([ROOT / "pyproject.toml", *(p for p in (ROOT / ".ci").rglob("*") if p.is_file())])


def _markdown() -> list[Path]:
    return sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                   *(ROOT / DESIGN_DIR).glob("*.md"), *(ROOT / "examples").rglob("*.md")])


def _design_texts() -> dict[str, str]:
    return {f"{DESIGN_DIR}/{p.name}": p.read_text(encoding="utf-8")
            for p in sorted((ROOT / DESIGN_DIR).glob("*.md"))}


def _pages() -> Pages:
    return design_pages(_design_texts())[0]


def _own_files(*suffixes: str) -> list[Path]:
    """The repository's own files with these suffixes: the tree without hidden folders and what
    .gitignore names (build outputs, run folders, venvs). A walk, not ``git ls-files``: a unit
    test starts no process."""
    ignored = [line.strip().strip("/") for line in
               (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
               if line.strip() and not line.startswith("#")]

    def skip(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        return name.startswith(".") or any(
            fnmatch.fnmatch(rel if "/" in pattern else name, pattern) for pattern in ignored)

    found = []
    for folder, dirs, files in os.walk(ROOT):
        base = Path(folder).relative_to(ROOT)
        dirs[:] = [d for d in dirs if not skip((base / d).as_posix())]
        found += [ROOT / base / f for f in files
                  if f.endswith(suffixes) and not skip((base / f).as_posix())]
    return sorted(found)


# -- the repository --------------------------------------------------------------------------

def test_design_sections_have_stable_anchors():
    texts = _design_texts()
    assert len(texts) > 10  # the design really is the folder of pages
    pages, problems = design_pages(texts)
    assert not problems, "\n".join(problems)
    missing = [a for a in KNOWN_ANCHORS if _page_of(pages, a) is None]
    assert not missing, f"the design pages lost anchors {missing}: anchors are never removed"


def test_sources_cite_existing_design_anchors():
    pages = _pages()
    files = _sources()
    assert len(files) > 50  # the scan really walks the packages
    problems = [p for f in files
                for p in check_source(str(f.relative_to(ROOT)), f.read_text(encoding="utf-8"),
                                      pages)]
    problems += [p for f in _other_citing_files()
                 for p in check_citations(str(f.relative_to(ROOT)),
                                          f.read_text(encoding="utf-8", errors="replace"), pages)]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_markdown_links_and_citations_resolve():
    pages = _pages()
    files = _markdown()
    assert len(files) > 10
    problems = [p for f in files
                for p in check_markdown(str(f.relative_to(ROOT)), f.read_text(encoding="utf-8"),
                                        pages, _read)]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_no_work_log_labels():
    files = _own_files(".py", ".md", ".toml")
    assert len(files) > 100  # the scan really walks the tracked files
    problems = [p for f in files
                for p in work_log_labels(str(f.relative_to(ROOT)),
                                         f.read_text(encoding="utf-8", errors="replace"))]
    assert not problems, f"{len(problems)} label(s):\n" + "\n".join(problems)


def test_benchmarks_page_stays_short():
    n = len((ROOT / "docs/benchmarks.md").read_text(encoding="utf-8").splitlines())
    assert n <= MAX_BENCHMARKS_LINES, (
        f"docs/benchmarks.md: {n} lines, more than {MAX_BENCHMARKS_LINES}; keep the newest "
        "measurement of each figure and leave earlier runs to git history")


def test_configuration_page_flag_table_is_the_generated_one():
    from replayrl.tools.run.flags import FLAGS, flag_table_markdown

    lines = (ROOT / "docs/configuration.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("| flag | default | allowed | meaning |")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    table = "\n".join(lines[start:end]) + "\n"
    assert table == flag_table_markdown(), (
        "docs/configuration.md's flag table is out of date: replace it with the output of "
        "python -m replayrl.tools.run.flags")
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
DOC = "docs/desi" + "gn.md"  # the single file the design once was
RD = "desi" + "gn/"  # the design's folder, from a page in docs/
D = "docs/" + RD  # the design's folder, from the repository root
CAPS = "docs/Desi" + "gn/traces.md"
WORK, HOME = "/" + "work/", "/" + "home/"
SMALL = {f"{D}README.md": {}, f"{D}traces.md": {"sample-contract": "Sample contract"},
         f"{D}math.md": {"trainer-math": "Trainer math"}}


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


def _page(*anchors: str) -> str:
    return "# Page\n\n" + "".join(f'<a id="{a}"></a>\n\n## {a.title()}\ntext\n' for a in anchors)


def test_design_pages_reads_every_page():
    texts = {f"{D}README.md": "# design\n\n1. [A](a.md): one.\n2. [B](b.md#two): two, three.\n",
             f"{D}a.md": _page("one"), f"{D}b.md": _page("two", "three")}
    assert design_pages(texts) == ({f"{D}README.md": {}, f"{D}a.md": {"one": "One"},
                                    f"{D}b.md": {"two": "Two", "three": "Three"}}, [])


@pytest.mark.parametrize("texts, expected", [
    ({f"{D}README.md": "[A](a.md) [B](b.md)\n", f"{D}a.md": _page("one"), f"{D}b.md": _page("one")},
     [f"{D}b.md: anchor 'one' is also on {D}a.md"]),
    ({f"{D}README.md": "[A](a.md)\n", f"{D}a.md": _page("one"), f"{D}b.md": _page("two")},
     [f"{D}README.md: does not link {D}b.md"]),
    ({f"{D}README.md": "[A](a.md)\n", f"{D}a.md": _page("one") + "more\n" * MAX_DESIGN_PAGE_LINES},
     [f"{D}a.md: {MAX_DESIGN_PAGE_LINES + 6} lines; a design page stays under"]),
    ({f"{D}a.md": _page("one")}, [f"{D}README.md: missing"]),
    ({f"{D}README.md": "[A](a.md)\n", f"{D}a.md": "# A\n## One\n"},
     [f"{D}a.md:2: heading '## One' lacks"]),
])
def test_design_pages_rejects(texts, expected):
    problems = design_pages(texts)[1]
    assert len(problems) == len(expected), problems
    for want, got in zip(expected, problems):
        assert want in got, problems


def test_github_slugs():
    text = ('<a id="x"></a>\n# Top\n## Your own prompts (`examples/own_data/`)\n## Top\n'
            "```\n## not a heading\n```\n")
    assert github_slugs(text) == {"x", "top", "your-own-prompts-examplesown_data", "top-1"}


@pytest.mark.parametrize("text", [
    f'"""Shapes ({D}traces.md#sample-contract)."""\n',
    f'"""See {D}math.md#trainer-math for the formulas."""\n',
    f'"""See {D}README.md."""\n',
    f'x = 1  # {D}math.md#trainer-math\n',
    f'path = "{WORK}data/x"  # a string literal is not a docstring\n',
    '"""Peak memory from /proc/self/status."""\n',
])
def test_checker_accepts(text):
    assert _check(text) == []


@pytest.mark.parametrize("text, expected", [
    (f'"""Rules ({OLD}#actor-contract)."""\n', [f"x.py:1: cites '{OLD}'"]),
    (f'"""See {WORK}shared/{OLD}."""\n',
     [f"cites '{WORK}shared/{OLD}'", f"absolute path '{WORK}shared/{OLD}.'"]),
    (f'"""Rules ({DOC}#sample-contract)."""\n', [f"cites '{DOC}'; the design is"]),
    (f'"""See {CAPS}#sample-contract."""\n', [f"cites '{CAPS}'"]),
    (f'"""See {D}nowhere.md#sample-contract."""\n', ["a design page that does not exist"]),
    (f'"""Shapes ({D}traces.md#sample-contracts)."""\n', ["#sample-contracts, an anchor"]),
    (f'"""Shapes ({D}math.md#sample-contract)."""\n', [f"; it is on {D}traces.md"]),
    (f'"""Shapes ({D}traces.md {SECT}3 "Sample contract")."""\n',
     [f"numbered section citation '{SECT}3'"]),
    (f'# large arrays go through shared memory ({SECT} 20)\n', ["numbered section citation"]),
    (f'"""Loaded from {HOME}alice/ckpt."""\n', [f"absolute path '{HOME}alice/ckpt.'"]),
    (f'def f():\n    pass  # written on {WORK}main\n', [f"x.py:2: absolute path '{WORK}main'"]),
])
def test_checker_rejects(text, expected):
    problems = _check(text)
    assert len(problems) == len(expected), problems
    for want, got in zip(expected, problems):
        assert want in got, problems


def test_citation_checker_reads_other_files():
    assert check_citations("pyproject.toml", f"# {D}math.md#trainer-math\n", SMALL) == []
    problems = check_citations("pyproject.toml", f"# hosts: {DOC} {SECT}17\n", SMALL)
    assert len(problems) == 2, problems
    assert f"pyproject.toml:1: cites '{DOC}'" in problems[0], problems
    assert f"numbered section citation '{SECT}17'" in problems[1], problems


FILES = {
    f"{D}README.md": "",
    f"{D}traces.md": '<a id="sample-contract"></a>\n\n## Sample contract\n',
    f"{D}math.md": '<a id="trainer-math"></a>\n\n## Trainer math\n',
    "docs/launchers.md": "# Launchers\n## Across hosts\n",
    "docs/gpu.md": "",
    "examples/own_data/README.md": "",
}


def _md(name: str, text: str) -> list[str]:
    return check_markdown(name, text, SMALL, lambda rel: FILES.get(str(rel)))


@pytest.mark.parametrize("name, text", [
    ("README.md", "See [the launchers](docs/launchers.md#across-hosts) and [gpu](docs/gpu.md).\n"),
    ("README.md", f"The [design]({D}README.md), [its math]({D}math.md#trainer-math).\n"),
    ("docs/gpu.md", f"[Sample contract]({RD}traces.md#sample-contract), "
                    "[up](../examples/own_data/README.md)\n"),
    (f"{D}math.md", "[Trainer math](#trainer-math)\n"),
    (f"{D}math.md", "[Sample contract](traces.md#sample-contract), [index](README.md)\n"),
    ("docs/gpu.md", "[site](https://example.com/x#y) and `[not](a link)`\n```\n[x](nowhere.md)\n```\n"),
])
def test_markdown_checker_accepts(name, text):
    assert _md(name, text) == []


@pytest.mark.parametrize("name, text, expected", [
    ("README.md", "[x](docs/nowhere.md)\n", ["no file 'docs/nowhere.md'"]),
    ("README.md", "[x](docs/launchers.md#across-host)\n", ["has no anchor 'across-host'"]),
    ("docs/gpu.md", f"[x]({RD}traces.md#layout)\n", [f"'{D}traces.md' has no anchor 'layout'"]),
    ("docs/gpu.md", f"[x]({RD}traces.md#trainer-math)\n", [f"(it is on {D}math.md)"]),
    ("docs/gpu.md", f"[x]({DOC[5:]}#trainer-math)\n", [f"cites '{DOC[5:]}'", f"no file '{DOC}'"]),
    ("docs/gpu.md", f"as {D}traces.md {SECT}7 says\n", ["numbered section citation"]),
    ("docs/gpu.md", f"see {D}math.md#trainer-maths\n", [f"an anchor {D}math.md does not have"]),
    (f"{D}math.md", "[x](#nowhere)\n", ["has no anchor 'nowhere'"]),
])
def test_markdown_checker_rejects(name, text, expected):
    problems = _md(name, text)
    assert len(problems) == len(expected), problems
    for want, got in zip(expected, problems):
        assert want in got, problems


# Spelt in pieces so that this file does not trip its own repository check.
CUT, CUTS, ISSUE = "cu" + "t", "cu" + "ts", "iss" + "ue"


@pytest.mark.parametrize("text", [
    "the push's slot is a third copy of the weights (docs/benchmarks.md#peer-grid)\n",
    "see https://github.com/vllm-project/vllm/issues/1234, verl#7340 and miles#2589\n",
    f"rank SIGKILLed instead of the {CUT} (B's torchrun reports -9); when the link is {CUT}\n",
    f"an {ISSUE} with 3 engines; {ISSUE}s arise; {CUT} into 2c chunks\n",
])
def test_work_log_accepts(text):
    assert work_log_labels("x.md", text) == []


@pytest.mark.parametrize("text, expected", [
    (f"# the RSS fell ({CUT} (18))\n", [f"x.md:1: work-log label '{CUT} (18)'"]),
    (f"measured before {CUTS} (1)-(6)\n", [f"'{CUTS} (1)'"]),
    (f"{CUT.title()} (4), third part\n", [f"'{CUT.title()} (4)'"]),
    (f'"""Loads no torch ({ISSUE} 24, memory)."""\n', [f"'{ISSUE} 24'"]),
    (f"one\n# {ISSUE} #8 item 1 and {ISSUE}s 13\n", [f"x.md:2: work-log label '{ISSUE} #8'",
                                                     f"x.md:2: work-log label '{ISSUE}s 13'"]),
])
def test_work_log_rejects(text, expected):
    problems = work_log_labels("x.md", text)
    assert len(problems) == len(expected), problems
    for want, got in zip(expected, problems):
        assert want in got, problems
