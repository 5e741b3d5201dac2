"""What the chaos soak (``replayrl bench faults --chaos``) checks in a run's rows; which processes it
may kill: tests/system/test_bench_chaos_targets.py."""
from __future__ import annotations

import pytest

from replayrl.tools.bench.chaos import check_rows


def _row(samples=16, groups=4, staleness=1, regenerated=0, alive=2, **extra):
    return {"samples": samples, "trained_groups": groups, "staleness_max": staleness,
            "groups_regenerated": regenerated, "engines_alive": alive, **extra}


def test_a_run_that_trained_every_configured_group_passes_with_its_counts_summed():
    rows = [_row(staleness=0), _row(regenerated=2, alive=1), _row(regenerated=1, alive=1,
                                                                  episodes_regenerated=3)]
    assert check_rows(rows, groups=4, n=4, max_staleness=1) == {
        "steps": 3, "groups_per_step": [4], "samples_lost": 0, "samples_duplicated": 0,
        "staleness_max": 1, "groups_regenerated": 3, "episodes_regenerated": 3,
        "engines_alive_min": 1, "ok": True}


@pytest.mark.parametrize("bad, key, value", [
    (_row(samples=12, groups=3), "samples_lost", 4),        # a group lost
    (_row(samples=20, groups=5), "samples_duplicated", 4),  # a group trained twice
    (_row(staleness=2), "staleness_max", 2),                # older than --max-staleness
])
def test_a_lost_duplicated_or_stale_step_fails_the_run(bad, key, value):
    report = check_rows([_row(), bad], groups=4, n=4, max_staleness=1)
    assert report[key] == value and report["ok"] is False


@pytest.mark.parametrize("argv, says", [
    (["--chaos", "5", "--", "--bogus-flag"], "the run's flags (after --): unrecognized arguments: --bogus-flag"),
    (["--chaos", "5", "--", "--n-samples-per-prompt", "1"], "--n-samples-per-prompt must be >= 2"),
    (["--", "--dp-size", "2"], "replayrl train flags are for --chaos only"),
    (["--chaos", "5", "--usage-every", "-1"], "--usage-every and --warmup-step must be >= 0"),
    (["--chaos", "5", "--time-budget-s", "0"], "--time-budget-s must be > 0, got 0.0"),
])
def test_a_bad_run_flag_is_one_line_before_anything_starts(argv, says, capsys):
    from replayrl.tools.bench import faults

    with pytest.raises(SystemExit) as info:
        faults.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
