"""``replayrl bench traces --quick`` runs in-process and prints the table its docs page holds;
its bound is the textbook one, checked by hand."""
from __future__ import annotations

import math

from replayrl.tools.bench import traces


def test_quick_prints_one_row_per_context_and_the_embedded_step(capsys):
    traces.main(["--quick"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "k |" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["4k", "32k", "128k"]
    # int32 per token: 78 x 2048 + 75 x 8 int32 = 641,376 bytes, as the issue counts it
    assert all(r.split("|")[2].strip() == "641,376" for r in rows)
    assert "embedded default step" in out
    assert "ESTIMATE, not a measurement" in out and "612 us per token per GPU" in out
    for r in rows:  # per rank = one core's time / 8 cores; share = per rank / 612 us
        cells = [c.strip().replace(",", "") for c in r.split("|")[1:-1]]
        one_core, per_rank, share = float(cells[7]), float(cells[8]), float(cells[9].rstrip(" %"))
        # the cells are printed rounded: one core to a whole us (+-0.5), per rank to 0.1 us (+-0.05)
        assert abs(per_rank - one_core / 8) <= 0.5 / 8 + 0.05 + 1e-9
        assert math.isclose(share, 100 * one_core / 8 / 612.0, rel_tol=0.01, abs_tol=0.1)


def test_the_step_estimate_is_six_flops_per_active_parameter():
    # 6 x 40.8e9 FLOPs at 400e12 FLOP/s: 612e-6 s per token
    assert math.isclose(traces.estimated_step_us_per_token(40.8e9, 400.0), 612.0, rel_tol=1e-9)
    assert math.isclose(traces.estimated_step_us_per_token(1e9, 1.0), 6000.0, rel_tol=1e-9)


def test_the_bound_counts_the_choices_of_k_of_n_keys():
    # context 4, k 2: positions 0..3 see 1..4 keys; C(1,1) C(2,2) C(3,2) C(4,2) = 1 1 3 6
    want = (0 + 0 + math.log2(3) + math.log2(6)) / 4
    assert math.isclose(traces.bound_bits_per_token(4, 2, 1), want, rel_tol=1e-9)
    assert math.isclose(traces.routing_bound_bits(4, 2), math.log2(12), rel_tol=1e-9)


def test_drawn_rows_are_causal_sets_with_window_and_sinks():
    import numpy as np

    rows = traces.draw_indexer_rows(np.array([2, 99]), 1, 8, 3, 2, np.random.default_rng(0))
    assert sorted(rows[0, 0].tolist()) == [-1] * 5 + [0, 1, 2]  # 3 keys <= k: all of them
    picked = set(rows[1, 0].tolist())
    assert len(picked) == 8 and {0, 1, 97, 98, 99} <= picked and max(picked) <= 99


def test_decode_threads_add_the_measured_columns(capsys):
    traces.main(["--quick", "--decode-threads", "2"])
    out = capsys.readouterr().out
    assert "indexer decode on 2 threads, wall us/token (measured)" in out
    assert "perfect scaling assumed" in out and "trainer batch's int64" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "k |" in line]
    for r in rows:
        cells = [c.strip().replace(",", "") for c in r.split("|")[1:-1]]
        assert len(cells) == 14 and float(cells[11]) > 0 and cells[12].endswith("x") and float(cells[13]) > 0
