"""Parity targets of the issue, measured on a small run of the parity benchmark."""
from __future__ import annotations

from replayrl.tools.bench.parity import run, table


def test_replays_make_trainer_match_engine():
    rows = {(r.precision, r.replays): r for r in run(prompts=24, seed=3, response_len=4)}
    same = rows[("fp32 / fp32", "all on")]
    assert same.routing_flips == 0 and same.indexer_flips == 0 and same.max_abs <= 1e-5
    on, off = rows[("bf16 / fp32", "all on")], rows[("bf16 / fp32", "all off")]
    assert on.routing_flips == 0 and on.indexer_flips == 0
    assert off.mean_abs >= 10 * on.mean_abs
    # each replay removes its own flips and no other
    assert rows[("bf16 / fp32", "routing (R3)")].routing_flips == 0
    assert rows[("bf16 / fp32", "indexer")].indexer_flips == 0
    assert "| bf16 / fp32 | all on |" in table(list(rows.values()))


def test_the_plot_goes_under_the_output_dir_and_is_named(tmp_path, monkeypatch, capsys):
    from replayrl.tools.bench.parity import main

    monkeypatch.chdir(tmp_path)
    assert main(["--prompts", "2", "--response-len", "2", "--output-dir", "out/p"]) == 0
    assert (tmp_path / "out" / "p" / "parity.png").stat().st_size > 0
    assert "plot: out/p/parity.png" in capsys.readouterr().out.splitlines()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing else in the cwd
    main(["--prompts", "2", "--response-len", "2"])  # the bench's convention: runs/parity
    assert (tmp_path / "runs" / "parity" / "parity.png").exists()
