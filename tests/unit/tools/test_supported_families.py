"""Every model type ``--hf-checkpoint`` reads is named where a reader looks: the README's list
and the refusal of another type, which ``replayrl bench parity`` gives as one line, exit 2.
The list is the family registry's, not a copy."""
from __future__ import annotations

import json
import re

import pytest

from replayrl.rollout.model.families import FAMILIES
from replayrl.tools import cli
from tests.paths import REPO

SUPPORTED = ("qwen3", "qwen3_moe", *FAMILIES)


def test_the_readme_names_every_type_hf_checkpoint_reads():
    text = (REPO / "README.md").read_text()
    start = text.index("`--hf-checkpoint DIR` trains a Hugging Face checkpoint")
    paragraph = text[start:text.index("\n\n", start)]
    named = set(re.findall(r"`([a-z0-9_]+)`", paragraph))
    assert set(SUPPORTED) <= named, sorted(set(SUPPORTED) - named)


def test_parity_refuses_another_model_type_in_one_line_listing_every_supported_one(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "parity", "--hf-checkpoint", str(tmp_path)])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "" and "Traceback" not in captured.err, captured
    assert lines[0].startswith(f"replayrl bench parity: error: --hf-checkpoint {tmp_path}: config.json "
                               "field 'model_type'='llama' is not supported (supported: ")
    listed = re.search(r"\(supported: (.*)\)", lines[0]).group(1)
    assert set(SUPPORTED) <= set(re.findall(r"[a-z0-9_]+", listed)), listed
