"""``replayrl bench load``: the summary against values computed by hand."""
from __future__ import annotations

import pytest

from replayrl.tools.bench.load import summarize


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


def test_replayrl_load_adds_one_model_not_two(tmp_path):
    """Peak resident memory a load adds, in a fresh process (replayrl.tools.bench.load's child): the
    fp32 model plus about one shard, well below two fp32 copies of the weights."""
    import argparse

    pytest.importorskip("transformers")
    from replayrl.tools.bench.load import run_child, write_checkpoint

    args = argparse.Namespace(hidden=256, layers=4, experts=8, vocab=8000, shard_size="8MB")
    n = write_checkpoint(args, tmp_path / "ckpt")
    model_mib = 4 * n / 2 ** 20
    result = run_child("replayrl", tmp_path / "ckpt", tmp_path / "logits.pt")
    if result["peak_kind"] == "ru_maxrss":
        pytest.skip("no resettable VmHWM here: ru_maxrss includes the imports")
    assert model_mib > 40  # large against allocator noise
    assert model_mib * 0.9 < result["peak_mib"] < model_mib * 1.5, (result, model_mib)
