"""The long soak's per-process figures (``replayrl bench faults --chaos --usage-every``): what is read
from /proc, and the start / end / peak table and its flat verdict, on hand-made samples."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from replayrl.tools.bench.chaos import read_rows, sample_usage
from replayrl.tools.bench.proc_usage import LAUNCHER, MIB, flat_rows, flat_table, is_flat, process_usage, sample_tree


@pytest.mark.parametrize("end_rss, end_fds, flat", [
    (130 * MIB, 12, True),       # 100 MiB x 1.10 + 20 MiB = 130 MiB, 10 + 2 fds: both at the limit
    (130 * MIB + 1, 10, False),  # one byte over
    (100 * MIB, 13, False),      # three more descriptors
    (50 * MIB, 4, True),         # shrinking is flat
])
def test_flat_allows_ten_percent_and_twenty_mib_of_rss_and_two_descriptors(end_rss, end_fds, flat):
    assert is_flat(100 * MIB, end_rss, 10, end_fds) is flat


def _proc(pid, name, rss_mib, fds, hwm_mib=None):
    return {"pid": pid, "name": name, "rss": rss_mib * MIB, "hwm": (hwm_mib or rss_mib) * MIB,
            "fds": fds}


SAMPLES = [  # a launcher, a trainer leaking 5 fds and 10 MiB per 100 steps, an engine replaced
    {"step": 0, "procs": [_proc(1, LAUNCHER, 200, 40), _proc(2, "rrl:trainer", 50, 30),
                          _proc(3, "rrl:engine_0", 10, 4)]},
    {"step": 100, "procs": [_proc(1, LAUNCHER, 201, 41), _proc(2, "rrl:trainer", 100, 30),
                            _proc(3, "rrl:engine_0", 240, 23, hwm_mib=300)]},
    {"step": 200, "procs": [_proc(1, LAUNCHER, 202, 40), _proc(2, "rrl:trainer", 110, 35),
                            _proc(9, "rrl:engine_0", 40, 4)]},   # pid 9: starting
    {"step": 300, "procs": [_proc(1, LAUNCHER, 203, 41), _proc(2, "rrl:trainer", 120, 40),
                            _proc(9, "rrl:engine_0", 250, 24)]},
]


def test_rows_start_after_warmup_end_last_and_name_a_replaced_engine():
    rows = {r["name"]: r for r in flat_rows(SAMPLES, warmup_step=100)}
    assert list(rows) == [LAUNCHER, "rrl:engine_0", "rrl:trainer"]  # the launcher first
    trainer = rows["rrl:trainer"]
    # three kept samples: windows of one (a quarter of three, at least one)
    assert trainer["start"] == {"steps": (100, 100), "pid": 2, "rss": 100 * MIB, "fds": 30}
    assert trainer["end"] == {"steps": (300, 300), "pid": 2, "rss": 120 * MIB, "fds": 40}
    # 10 MiB per 100 steps over steps 100..300
    assert trainer["slope"] == pytest.approx(100.0)
    assert trainer["flat"] is False and trainer["replaced_at"] is None and trainer["pids"] == 1
    engine = rows["rrl:engine_0"]
    # each pid's first sample (pid 3 at step 0, pid 9 at step 200) is left out
    assert engine["start"] == {"steps": (100, 100), "pid": 3, "rss": 240 * MIB, "fds": 23}
    assert engine["end"] == {"steps": (300, 300), "pid": 9, "rss": 250 * MIB, "fds": 24}
    assert engine["replaced_at"] == 200 and engine["pids"] == 2
    assert engine["peak_hwm"] == 300 * MIB and engine["flat"] is True
    assert rows[LAUNCHER]["flat"] is True and rows[LAUNCHER]["slope"] == pytest.approx(10.0)


def test_the_table_says_which_process_grows_and_which_was_replaced():
    table = flat_table(SAMPLES, warmup_step=100)
    lines = {line.split(" |")[0]: line for line in table.splitlines() if line.startswith("| ")}
    assert lines["| rrl:trainer"].endswith("| 100 - 300 | 100 / 120 / 120 | 30 / 40 | +100.00 | GROWS |")
    engine = next(v for k, v in lines.items() if k.startswith("| rrl:engine_0"))
    assert "replacement pid 9" in engine and engine.endswith("| 240 / 250 / 300 | 23 / 24 | — | flat |")
    with pytest.raises(ValueError, match="no usage samples"):
        flat_rows([], warmup_step=50)


def _steady(fds: list[int]) -> list[dict]:
    """Samples at steps 0, 10, ... of one process with these fds (RSS constant)."""
    return [{"step": 10 * i, "procs": [_proc(5, "rrl:trainer", 100, n)]} for i, n in enumerate(fds)]


def test_a_one_sample_spike_is_no_growth_but_a_steady_climb_is():
    # 21 samples, 20 kept (the first is left out): windows of 5 at each end
    spike = flat_rows(_steady([50] * 20 + [60]), warmup_step=0)[0]
    assert (spike["start"]["fds"], spike["end"]["fds"], spike["flat"]) == (50, 50, True)
    assert spike["start"]["steps"] == (10, 50) and spike["end"]["steps"] == (160, 200)
    climb = flat_rows(_steady(list(range(50, 71))), warmup_step=0)[0]
    # kept fds 51..70: first five 51..55 (median 53), last five 66..70 (median 68)
    assert (climb["start"]["fds"], climb["end"]["fds"], climb["flat"]) == (53, 68, False)


def test_a_process_sampled_before_it_named_itself_counts_under_its_actor():
    samples = [{"step": 0, "procs": [_proc(7, "python3.11", 30, 4), _proc(8, "python3.11", 20, 4)]},
               {"step": 10, "procs": [_proc(7, "rrl:engine_1", 250, 23)]},
               {"step": 20, "procs": [_proc(7, "rrl:engine_1", 251, 23)]}]
    rows = flat_rows(samples, warmup_step=0)
    # pid 8 was sampled once (killed while starting): no row; pid 7's first sample is its start-up
    assert [r["name"] for r in rows] == ["rrl:engine_1"]
    assert rows[0]["start"]["rss"] == 250 * MIB and rows[0]["pids"] == 1


def _fake_proc(root: Path, pid: int, ppid: int, comm: str, rss_kib: int | None, fds=()):
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0\n")
    (d / "comm").write_text(comm + "\n")
    status = "Name:\tx\n" + (f"VmHWM:\t{rss_kib * 2} kB\nVmRSS:\t{rss_kib} kB\n" if rss_kib else "")
    (d / "status").write_text(status)
    for i, target in enumerate(fds):
        os.symlink(target, d / "fd" / str(i))


def test_a_sample_reads_the_tree_below_the_root_and_leaves_out_zombies_and_strangers(tmp_path):
    _fake_proc(tmp_path, 10, 1, "replayrl", 1000, ["/dev/null", "socket:[5]"])
    _fake_proc(tmp_path, 11, 10, "rrl:trainer", 2000, ["socket:[6]", "socket:[7]", "pipe:[8]",
                                                       "/dev/shm/x", "/tmp/f",
                                                       "/memfd:replayrl-shm (deleted)"])
    _fake_proc(tmp_path, 12, 11, "rrl:helper", 3000, [])
    _fake_proc(tmp_path, 13, 1, "rrl:other", 4000, ["/tmp/f"])   # not below the root
    _fake_proc(tmp_path, 14, 10, "rrl:engine_0", None)           # a zombie: no VmRSS
    sample = sample_tree(10, step=7, proc=tmp_path, now=5.0)
    assert sample["step"] == 7 and sample["time"] == 5.0
    assert sorted(sample["procs"], key=lambda p: p["pid"]) == [
        {"pid": 10, "name": LAUNCHER, "rss": 1000 * 1024, "hwm": 2000 * 1024, "fds": 2,
         "fd_kinds": {"dev": 1, "socket": 1}},
        {"pid": 11, "name": "rrl:trainer", "rss": 2000 * 1024, "hwm": 4000 * 1024, "fds": 6,
         "fd_kinds": {"socket": 2, "pipe": 1, "shm": 1, "file": 1, "memfd": 1}},
        {"pid": 12, "name": "rrl:helper", "rss": 3000 * 1024, "hwm": 6000 * 1024, "fds": 0,
         "fd_kinds": {}}]


def test_this_process_counts_one_more_descriptor_for_an_open_file(tmp_path):
    before = process_usage(os.getpid())
    with open(tmp_path / "f", "w"):
        after = process_usage(os.getpid())
    assert after["fds"] == before["fds"] + 1
    assert after["fd_kinds"]["file"] == before["fd_kinds"].get("file", 0) + 1
    assert 0 < after["rss"] <= after["hwm"]


def test_samples_are_taken_each_time_the_metrics_pass_a_multiple_of_n_rows(tmp_path):
    metrics, out, samples = tmp_path / "metrics.jsonl", tmp_path / "usage.jsonl", []

    async def run():
        task = asyncio.ensure_future(sample_usage(metrics, 2, samples, out, poll_s=0.01))
        for rows in (1, 2, 3, 5):  # cumulative rows written, a poll after each
            metrics.write_text('{"step": 0}\n' * rows)
            await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert [s["step"] for s in samples] == [2, 5]  # 1 row: none yet; 3 rows: 4 not reached
    assert len(out.read_text().splitlines()) == 2
    assert samples[0]["procs"][0]["name"] == LAUNCHER


def test_rows_of_a_stopped_run_leave_out_a_line_cut_by_the_stop(tmp_path):
    (tmp_path / "m.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"ste')
    assert read_rows(tmp_path / "m.jsonl") == [{"step": 0}, {"step": 1}]
    assert read_rows(tmp_path / "missing.jsonl") == []
