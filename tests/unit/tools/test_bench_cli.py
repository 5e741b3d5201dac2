"""``replayrl bench NAME --help``: every benchmark's usage line names the command a user typed."""
from __future__ import annotations

import importlib

import pytest

from replayrl.tools.cli import BENCHES


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_help_shows_the_replayrl_command(name, capsys):
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(BENCHES[name]).main(["--help"])
    assert exited.value.code == 0
    # argparse's default prog is the script's file name: 'cli.py' under the console script
    assert capsys.readouterr().out.startswith(f"usage: replayrl bench {name} ")
