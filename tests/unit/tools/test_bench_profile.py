"""replayrl bench profile's pieces: the *_seconds breakdown and the per-actor profile files."""
from __future__ import annotations

import cProfile

from replayrl.actors.profiling import write_profile
from replayrl.tools.bench.profile import breakdown, top_functions


def test_breakdown_is_the_median_of_each_seconds_key_after_warmup():
    rows = [{"step_seconds": 9.0, "reward_mean": 0.1},            # warm-up, skipped
            {"step_seconds": 1.0, "train_seconds": 0.5, "reward_mean": 0.2},
            {"step_seconds": 3.0, "train_seconds": 0.7},
            {"step_seconds": 2.0}]
    assert breakdown(rows, warmup=1) == {"step_seconds": 2.0, "train_seconds": 0.6}
    assert breakdown(rows[:1], warmup=5) == {"step_seconds": 9.0}  # too few: all rows


def _busy(n):
    return sum(i * i for i in range(n))


def test_profile_files_name_the_functions_that_took_the_time(tmp_path):
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(4):
        _busy(20000)
    profile.disable()
    text = write_profile(profile, tmp_path, "trainer")
    assert (tmp_path / "trainer.prof").exists() and "_busy" in text.read_text()
    top = top_functions(tmp_path / "trainer.prof", steps=4, top=5)
    names = [name for name, _, _ in top]
    assert any("_busy" in n or "genexpr" in n for n in names)
    busy = next(row for row in top if "_busy" in row[0] or "genexpr" in row[0])
    assert busy[1] > 0 and busy[2] >= 1  # seconds and calls per step
