"""``replayrl train / repl / serve --help``: every option says its default (or that it repeats),
as a newcomer reads it at the terminal."""
from __future__ import annotations

import pytest

from replayrl.tools.cli import build_parser

WITHOUT_DEFAULT = {"--config CONFIG"}  # a file to read the flags from: nothing is read without it


def _options(help_text: str) -> dict[str, str]:
    """``{option: its help on one line}`` of an argparse ``--help`` text."""
    options: dict[str, str] = {}
    name = None
    for line in help_text.split("\noptions:\n", 1)[1].splitlines():
        if line.startswith("  -"):
            name, _, text = line.strip().partition("  ")
            options[name] = text.strip()
        elif line.startswith("   ") and name:
            options[name] = (options[name] + " " + line.strip()).strip()
    return options


@pytest.mark.parametrize("command", ["train", "repl", "serve"])
def test_every_option_shows_its_default(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    options = _options(capsys.readouterr().out)
    assert len(options) > 3
    missing = [f"{name}: {text}" for name, text in options.items()
               if name not in WITHOUT_DEFAULT and not name.startswith("-h,")
               and "(default" not in text and "(repeatable)" not in text]
    assert not missing, missing
