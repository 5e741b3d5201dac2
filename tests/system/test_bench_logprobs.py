"""Smoke test of tools/bench/logprobs.py at vocabulary 1000: the table has one row per (path, N)
and every path agrees with the full-vocabulary logprob on rows whose support is the vocabulary.
No timing is asserted."""

from __future__ import annotations

import pytest
import torch

from replayrl.tools.bench.logprobs import PATHS, BenchConfig, main, make_inputs, measure_here


def _table_rows(text: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r] for r in rows[1:]]  # drop the header row


def test_bench_table_at_tiny_size(capsys):
    # One N: each configuration is a fresh process (a torch import), the cost of this test.
    assert main(["--vocab", "1000", "--hidden", "32", "--top-k", "20", "--tokens", "24",
                 "--eos-every", "4", "--repeats", "1", "--jobs", "3"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert [(r[0], int(r[1])) for r in rows] == [(p, 24) for p in PATHS]
    for path, n, seconds, calls, t_ratio, peak, m_ratio, full_rows, dlogp, dgrad in rows:
        assert float(seconds) > 0 and calls == "1" and float(peak) >= 0
        if path == "full":
            # page-granular RSS may see no growth at this size; then the ratio is undefined. A
            # growth below 0.05 MiB prints as "0.0" while its ratio to itself is still 1.000
            assert t_ratio == "1.000" and m_ratio in ("n/a", "1.000")
            assert m_ratio == "1.000" or float(peak) == 0
        assert int(full_rows) == int(n) // 4  # the synthetic-EOS rows
        assert float(dlogp) < 1e-5 and float(dgrad) < 1e-5


@pytest.mark.parametrize("path", PATHS)
def test_every_row_full_support_when_top_k_is_the_vocabulary(path):
    cfg = BenchConfig(vocab=1000, hidden=16, top_k=1000, eos_every=0, repeats=1)
    m = measure_here(cfg, path, 12)
    assert m.full_support_rows == 12
    assert m.max_abs_dlogp < 1e-5 and m.max_abs_dgrad < 1e-5


def test_inputs_follow_the_support_contract():
    x = make_inputs(BenchConfig(vocab=50, hidden=4, top_k=6, eos_every=3), 7)
    assert x.support.shape == (7, 7)
    assert x.fallback.tolist() == [2, 5] and x.full_rows.tolist() == [2, 5]
    for i, row in enumerate(x.support.tolist()):
        assert row[0] == x.targets[i]
        if i in (2, 5):
            assert row[1:] == [-1] * 6  # synthetic EOS: no captured support
        else:
            assert row[1] == row[0] and len(set(row[1:])) == 6 and all(0 <= v < 50 for v in row[1:])
    assert make_inputs(BenchConfig(vocab=50, hidden=4, top_k=6, eos_every=8), 7).fallback.numel() == 0
    full = make_inputs(BenchConfig(vocab=9, hidden=4, top_k=9, eos_every=0), 3)
    assert all(sorted(r[1:]) == list(range(9)) for r in full.support.tolist())
    assert torch.equal(full.full_rows, torch.arange(3))
