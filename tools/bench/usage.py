"""The command line every ``replayrl bench NAME`` shares: its parser, whose help shows each
option's default, and the one-line summary of a benchmark that ``replayrl bench`` lists.

A benchmark's summary is the first paragraph of its module docstring, without the
``replayrl bench NAME``: / ``Benchmark:`` lead-in, the "(not a test)" aside and reST markup: the
docstring stays the one place that says what the benchmark is for.
"""
from __future__ import annotations

import argparse
import ast
import re
import textwrap
from pathlib import Path

_LEAD_IN = re.compile(r"^(?:``replayrl bench [^`]*``|Benchmark):\s*")
_NOT_A_TEST = re.compile(r"\s*\(not a test[^)]*\)")
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
DESCRIPTION_WIDTH = 78
"""Columns of a benchmark's one-line summary at the top of its ``--help``."""


def plain(text: str) -> str:
    """``text`` without reST markup: ````x```` and ``:role:`x``` become ``x``."""
    return _ROLE.sub(r"\1", text).replace("``", "")


def summary(doc: str) -> str:
    """One line saying what a benchmark is for: the first paragraph of its module docstring
    ``doc`` joined into one line, the lead-in and "(not a test)" aside dropped, ending in a full
    stop."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    text = plain(_NOT_A_TEST.sub("", _LEAD_IN.sub("", paragraph)))
    if not text.startswith("replayrl"):  # the project's name stays lower case
        text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def summary_of_file(path: str | Path) -> str:
    """:func:`summary` of the module docstring of the source file ``path``, read without
    importing it (benchmarks import torch at the top; ``replayrl bench`` lists them in a blink)."""
    return summary(ast.get_docstring(ast.parse(Path(path).read_text())) or "")


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter,
                            argparse.ArgumentDefaultsHelpFormatter):
    """Help texts end with ``(default: X)``, unless the text already names its default
    (``(default ...`` or ``default: ...`` in it); the description keeps its line breaks
    (:func:`bench_parser` wraps it).

    An option whose default is ``None`` or empty says in its own text what leaving it out does
    (``(default: ...)``); a switch's default shows as ``off`` / ``on``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        named = "(default" in text or "default:" in text or "%(default)" in text
        if (named or not action.option_strings or default is argparse.SUPPRESS
                or default is None or default in ("", [], ())):
            return text
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif isinstance(default, (list, tuple)):
            shown = " ".join(str(v) for v in default)
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def bench_parser(name: str, doc: str, details: bool = False, **kwargs) -> argparse.ArgumentParser:
    """The parser of ``replayrl bench NAME``: its usage names that command, its description is
    :func:`summary` of the benchmark's docstring ``doc`` (with ``details``, followed by the rest
    of the docstring as written) and every option shows its default."""
    description = textwrap.fill(summary(doc), DESCRIPTION_WIDTH)
    if details:
        rest = doc.strip().split("\n\n", 1)[1:]
        description += "".join(f"\n\n{plain(textwrap.dedent(text).strip())}" for text in rest)
    return argparse.ArgumentParser(prog=f"replayrl bench {name}", description=description,
                                   formatter_class=DefaultsHelpFormatter, **kwargs)
