"""``replayrl bench traces --quick`` runs in-process and prints the table its docs page holds;
its bound is the textbook one, checked by hand."""
from __future__ import annotations

import math

from replayrl.tools.bench import traces


def _rows(out: str) -> list[list[str]]:
    """The table's data rows, cells stripped, thousands separators dropped."""
    return [[c.strip().replace(",", "") for c in line.split("|")[1:-1]]
            for line in out.splitlines() if line.startswith("| ") and "k |" in line]


def test_quick_prints_one_row_per_shape_and_context_and_the_embedded_step(capsys):
    traces.main(["--quick"])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert [r[:2] for r in rows] == [[m, c] for m in ("GLM-5", "DeepSeek-V4") for c in ("4k", "32k", "128k")]
    # int32 per token: 78 x 2048 + 75 x 8 int32 = 641,376 bytes, as the issue counts it; DeepSeek-V4:
    # 20 CSA layers x 512 + 40 top-k MoE layers x 6 int32 = 41,920 (its 3 hash-routed layers: none)
    assert [r[2] for r in rows] == ["641376"] * 3 + ["41920"] * 3
    assert [r[3] for r in rows] == ["638976"] * 3 + ["40960"] * 3
    assert "embedded default step" in out
    assert "ESTIMATE, not a measurement" in out and "612 us per token per GPU" in out
    # DeepSeek-V4: 6 x 13.3e9 FLOPs at 400e12 FLOP/s: 199.5 us
    assert "6 x 13.3 B active params" in out and "200 us per token per GPU" in out
    for r in rows:  # per rank = one core's time / 8 cores; share = per rank / the shape's step
        step = 612.0 if r[0] == "GLM-5" else 199.5
        one_core, per_rank, share = float(r[8]), float(r[9]), float(r[10].rstrip(" %"))
        # the cells are printed rounded: one core to a whole us (+-0.5), per rank to 0.1 us (+-0.05)
        assert abs(per_rank - one_core / 8) <= 0.5 / 8 + 0.05 + 1e-9
        assert math.isclose(share, 100 * one_core / 8 / step, rel_tol=0.01, abs_tol=0.1)
    v4_bound_4k = float(rows[3][6])  # bytes: from the hand-checked bound below
    want = (traces.bound_bits_per_token(4096, 512, 20, 4) + 40 * traces.routing_bound_bits(256, 6)) / 8
    assert abs(v4_bound_4k - want) <= 0.5


def test_the_step_estimate_is_six_flops_per_active_parameter():
    # 6 x 40.8e9 FLOPs at 400e12 FLOP/s: 612e-6 s per token
    assert math.isclose(traces.estimated_step_us_per_token(40.8e9, 400.0), 612.0, rel_tol=1e-9)
    assert math.isclose(traces.estimated_step_us_per_token(1e9, 1.0), 6000.0, rel_tol=1e-9)


def test_the_bound_counts_the_choices_of_k_of_n_keys():
    # context 4, k 2: positions 0..3 see 1..4 keys; C(1,1) C(2,2) C(3,2) C(4,2) = 1 1 3 6
    want = (0 + 0 + math.log2(3) + math.log2(6)) / 4
    assert math.isclose(traces.bound_bits_per_token(4, 2, 1), want, rel_tol=1e-9)
    assert math.isclose(traces.routing_bound_bits(4, 2), math.log2(12), rel_tol=1e-9)


def test_the_bound_of_compressed_entries_counts_the_entries_a_query_sees():
    # context 12, rate 4, k 2: positions 0..11 see 0 0 0 1 1 1 1 2 2 2 2 3 entries (not p + 1 keys);
    # C(n, min(2, n)) is 1 for every n <= 2 and C(3, 2) = 3 at the last position
    assert math.isclose(traces.bound_bits_per_token(12, 2, 1, 4), math.log2(3) / 12, rel_tol=1e-9)
    # two layers: twice; over p + 1 keys it would be C(p + 1, 2) from p = 2 on, far more
    assert math.isclose(traces.bound_bits_per_token(12, 2, 2, 4), 2 * math.log2(3) / 12, rel_tol=1e-9)
    keys = sum(math.log2(math.comb(n, 2)) for n in range(3, 13)) / 12
    assert math.isclose(traces.bound_bits_per_token(12, 2, 1), keys, rel_tol=1e-9)
    # DeepSeek-V4 at 4k: 1024 entries at the last position, from 2047 on more than 512 of them
    n = [(p + 1) // 4 for p in range(4096)]
    want = sum(math.log2(math.comb(m, min(512, m))) for m in n) / 4096
    assert math.isclose(traces.bound_bits_per_token(4096, 512, 1, 4), want, rel_tol=1e-9)


def test_drawn_rows_are_causal_sets_with_window_and_sinks():
    import numpy as np

    rows = traces.draw_indexer_rows(np.array([2, 99]), 1, 8, 3, 2, np.random.default_rng(0))
    assert sorted(rows[0, 0].tolist()) == [-1] * 5 + [0, 1, 2]  # 3 keys <= k: all of them
    picked = set(rows[1, 0].tolist())
    assert len(picked) == 8 and {0, 1, 97, 98, 99} <= picked and max(picked) <= 99
    # compressed entries of 4 keys: position 10 sees 11 // 4 = 2 entries, position 99 sees 25
    rows = traces.draw_indexer_rows(np.array([10, 99]), 1, 8, 3, 2, np.random.default_rng(0), rate=4)
    assert sorted(rows[0, 0].tolist()) == [-1] * 6 + [0, 1]
    picked = set(rows[1, 0].tolist())
    assert len(picked) == 8 and {0, 1, 22, 23, 24} <= picked and max(picked) <= 24


def test_one_shape_is_measured_alone_and_a_step_flag_needs_one_shape(capsys):
    import pytest

    traces.main(["--quick", "--shape", "deepseek_v4", "--active-params", "1e9"])
    out = capsys.readouterr().out
    assert [r[:2] for r in _rows(out)] == [["DeepSeek-V4", c] for c in ("4k", "32k", "128k")]
    assert "GLM-5 shape" not in out and "= 15 us per token per GPU" in out  # 6e9 / 400e12 s
    with pytest.raises(SystemExit) as err:
        traces.main(["--quick", "--active-params", "1e9"])
    assert err.value.code == 2
    assert "give one --shape" in capsys.readouterr().err


def test_decode_threads_add_the_measured_columns(capsys):
    traces.main(["--quick", "--decode-threads", "2"])
    out = capsys.readouterr().out
    assert "indexer decode on 2 threads, wall us/token (measured)" in out
    assert "perfect scaling assumed" in out and "trainer batch's int64" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "k |" in line]
    for r in rows:
        cells = [c.strip().replace(",", "") for c in r.split("|")[1:-1]]
        assert len(cells) == 15 and float(cells[12]) > 0 and cells[13].endswith("x") and float(cells[14]) > 0
