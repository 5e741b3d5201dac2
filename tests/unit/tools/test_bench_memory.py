"""``replayrl bench memory``: its table's medians and ratios, checked by hand, and the per-process
peaks of a fake ``/proc`` tree named by ``comm``."""
from __future__ import annotations

import pytest

from replayrl.tools.bench import memory
from replayrl.tools.bench import tree_memory as tm


def _run(rss: float, pss: float, seconds: float, **procs: tuple[float, float]) -> memory.MemoryRun:
    return memory.MemoryRun(rss, pss, seconds, dict(procs))


def _cells(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
    return [c.strip() for c in line.split("|")[2:-1]]


def test_the_table_gives_medians_over_runs_and_b_over_a():
    a = [_run(1000, 700, 30.0, engine=(400, 300)), _run(1200, 800, 34.0, engine=(420, 310)),
         _run(1100, 900, 32.0, engine=(410, 305))]
    b = [_run(600, 500, 40.0, engine=(300, 200)), _run(700, 450, 44.0),
         _run(650, 400, 42.0, engine=(320, 220))]
    text = memory.table("abc123", "this checkout --colocate", a, b)
    assert "| A: abc123 | B: this checkout --colocate |" in text
    # medians 1100 / 650 (ratio 650 / 1100 = 0.59), 800 / 450 (0.56), 32.0 / 42.0 (1.31)
    assert _cells(text, "tree peak RSS, MiB") == ["1,100", "650", "0.59"]
    assert _cells(text, "tree peak PSS, MiB") == ["800", "450", "0.56"]
    assert _cells(text, "wall seconds") == ["32.0", "42.0", "1.31"]
    # B's engine ran in two of three runs: the median of those two, 310 (RSS) and 210 (PSS)
    assert _cells(text, "`engine` peak RSS, MiB") == ["410", "310", "0.76"]
    assert _cells(text, "`engine` peak PSS, MiB") == ["305", "210", "0.69"]


def test_a_process_one_side_never_ran_is_not_a_number_there():
    text = memory.table("x", "y", [_run(10, 5, 1.0, clock=(4, 2))], [_run(10, 5, 1.0)])
    assert _cells(text, "`clock` peak RSS, MiB") == ["4", "n/a", "n/a"]


def test_nothing_to_compare_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        memory.main(["--runs", "1"])
    assert exc.value.code == 2
    assert "nothing to compare" in capsys.readouterr().err


def test_usage_is_kept_per_comm_name_and_summed_within_a_name(tmp_path):
    # 10 -> 11, 10 -> 12, 11 -> 13; 11 and 12 are both "rrl:engine_0"; 13 is gone (no status)
    tree = {10: 1, 11: 10, 12: 10, 13: 11}
    names = {10: "replayrl", 11: "rrl:engine_0", 12: "rrl:engine_0", 13: "x"}
    for pid, ppid in tree.items():
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (a b) S {ppid} 0 0\n")
        (d / "comm").write_text(names[pid] + "\n")
        if pid != 13:
            (d / "status").write_text(f"VmRSS:\t{pid} kB\n")
            (d / "smaps_rollup").write_text(f"Pss: {pid * 2} kB\n")
    assert tm.usage_by_name(10, tmp_path) == {"replayrl": (10 * 1024, 20 * 1024),
                                              "rrl:engine_0": (23 * 1024, 46 * 1024)}
    assert tm.tree_usage(10, tmp_path) == (33 * 1024, 66 * 1024)
