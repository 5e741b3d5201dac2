"""The command line every ``replayrl bench NAME`` shares: its parser, whose help shows each
option's default and whose errors are one line (exit 2), and the one-line summary of a
benchmark that ``replayrl bench`` lists.

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

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.exit_codes import EXIT_CONFIG

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


class BenchParser(argparse.ArgumentParser):
    """A benchmark's parser: a bad flag or value ends the command in one line on stderr, exit
    code 2, as ``replayrl train`` answers bad input (argparse's own error prints the whole usage
    first)."""

    def error(self, message: str) -> None:
        """Print ``PROG: error: MESSAGE`` and where the flags are described; exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` describes the flags)\n")


def at_least(low: int | float, kind: type = int):
    """An argparse ``type`` that reads ``kind`` and refuses values below ``low`` (argparse then
    names the flag: ``argument --calls: must be >= 1, got 0``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def bench_parser(name: str, doc: str, details: bool = False, **kwargs) -> argparse.ArgumentParser:
    """The parser of ``replayrl bench NAME``: its usage names that command, its description is
    :func:`summary` of the benchmark's docstring ``doc`` (with ``details``, followed by the rest
    of the docstring as written) and every option shows its default."""
    description = textwrap.fill(summary(doc), DESCRIPTION_WIDTH)
    if details:
        rest = doc.strip().split("\n\n", 1)[1:]
        description += "".join(f"\n\n{plain(textwrap.dedent(text).strip())}" for text in rest)
    return BenchParser(prog=f"replayrl bench {name}", description=description,
                       formatter_class=DefaultsHelpFormatter, **kwargs)


CONFIG_ERROR_PREFIX = "replayrl: configuration error: "
"""How ``replayrl train`` starts the one line of a refusal (:func:`replayrl.tools.run.exit_codes.exit_code`)."""


def train_refusal(returncode: int, output: str) -> ConfigError | None:
    """For a ``replayrl train`` child that refused its flags before starting (exit 2), a
    :class:`ConfigError` with its one-line reason, for the benchmark to raise as its own bad
    input (one line, exit 2, instead of a traceback around the child's output); None for any
    other exit. ``output``: the child's stderr (or stdout and stderr)."""
    if returncode != EXIT_CONFIG:
        return None
    lines = [line[len(CONFIG_ERROR_PREFIX):] for line in output.splitlines()
             if line.startswith(CONFIG_ERROR_PREFIX)]
    return ConfigError(f"replayrl train refused the flags: {lines[-1] if lines else output.strip()[-500:]}")
