"""``replayrl bench load``: the summary against values computed by hand."""
from __future__ import annotations

import pytest

from tools.bench_load import summarize


def test_summary_by_hand():
    results = {"replayrl": [{"seconds": 0.5, "peak_mib": 400.0}, {"seconds": 0.4, "peak_mib": 410.0}],
               "transformers": [{"seconds": 2.0, "peak_mib": 800.0}, {"seconds": 1.6, "peak_mib": 820.0}]}
    best = summarize(results)
    assert best["replayrl"] == {"seconds": 0.4, "peak_mib": 410.0}  # best time, worst peak
    assert best["transformers"] == {"seconds": 1.6, "peak_mib": 820.0}
    assert best["ratio"] == {"seconds": pytest.approx(0.25), "peak_mib": pytest.approx(0.5)}


def test_missing_loader_is_an_error():
    with pytest.raises(KeyError):
        summarize({"replayrl": [{"seconds": 1.0, "peak_mib": 1.0}]})
