"""``replayrl bench peer --grid``: grid parsing, per-side figures, ratios, the table, the plot and
the /proc tree-memory arithmetic, against values worked out by hand."""
from __future__ import annotations

import pytest

from replayrl.tools.bench import peer_grid as pg
from replayrl.tools.bench import tree_memory as tm
from replayrl.tools.bench.peer import SideRun
from replayrl.tools.errors import BenchError, PeerBenchError

MIB = 1024 * 1024


def test_named_and_spelled_out_grids():
    assert pg.parse_grid("quick") == [pg.GridPoint("1m", 2), pg.GridPoint("1m", 64)]
    full = pg.parse_grid("full")
    assert len(full) == 9 and full[0] == pg.GridPoint("1m", 2) and full[-1] == pg.GridPoint("50m", 256)
    assert pg.parse_grid("1m,10m:2,64") == [pg.GridPoint("1m", 2), pg.GridPoint("1m", 64),
                                            pg.GridPoint("10m", 2), pg.GridPoint("10m", 64)]
    assert pg.GridPoint("1m", 2).overrides() == {"model-size": "1m", "rollout-max-response-len": 2}
    # 64 new tokens: 63 digits to sort, then EOS
    assert pg.GridPoint("10m", 64).overrides() == {"model-size": "10m", "task": "sort", "answer-tokens": 63,
                                                   "rollout-max-response-len": 64}


@pytest.mark.parametrize("text, message", [
    ("huge", "quick, full or SIZES:LENGTHS"),
    ("2m:2", "unknown model size '2m'"),
    ("1m:two", "must be integers"),
    ("1m:1", ">= 2"),
    ("1m:2,2", "repeated"),
])
def test_bad_grids_are_refused(text, message):
    with pytest.raises(BenchError, match=message):
        pg.parse_grid(text)


def test_steady_rate_by_hand():
    # 10 steps: step 1 is warm-up; per-step rates of the other nine: 100/1, 200/2 ... all 100
    # except one 300/1 -> median 100
    amounts = [50, 100, 200, 300, 100, 100, 100, 100, 100, 100]
    seconds = [5.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert pg.steady_rate(amounts, seconds) == pytest.approx(100.0)
    assert pg.steady_rate([8], [2.0]) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        pg.steady_rate([1, 2], [1.0])


def _run(side, seconds, generated, trained, train_seconds, rewards, rss=None, pss=None):
    return SideRun(side, 1, tuple(seconds), tuple(rewards), (4,) * len(seconds), tuple(generated),
                   tuple(trained), tuple(train_seconds), rss, pss)


def test_side_figures_by_hand():
    # 3 steps: the first is warm-up; steps 2-3: 4 completions in 1 s and 2 s -> 4/s and 2/s,
    # median 3/s; generated 40 and 60 tokens -> 40/s and 30/s, median 35/s; trained 100 tokens in
    # 0.5 s and 0.25 s -> 200/s and 400/s, median 300/s; mean answer (20+40+60)/12 = 10 tokens;
    # last two rewards 0.5 and 1.0 -> 0.75
    run = _run("x", [9.0, 1.0, 2.0], [20, 40, 60], [80, 100, 100], [1.0, 0.5, 0.25],
               [0.0, 0.5, 1.0], 3 * MIB, 2 * MIB)
    f = pg.side_figures(run, window=2)
    assert f.completions_per_second == pytest.approx(3.0)
    assert f.generated_tokens_per_second == pytest.approx(35.0)
    assert f.trainer_tokens_per_second == pytest.approx(300.0)
    assert f.mean_answer_tokens == pytest.approx(10.0)
    assert f.final_reward == pytest.approx(0.75)
    assert (f.peak_rss_bytes, f.peak_pss_bytes) == (3 * MIB, 2 * MIB)
    assert pg.side_figures(run, window=10).final_reward == pytest.approx(0.5)  # all three steps
    with pytest.raises(PeerBenchError, match="tokens or trainer seconds missing"):
        pg.side_figures(SideRun("x", 1, (1.0,), (0.0,), (4,)), window=1)


def _result(size="1m", n=2):
    ours = pg.SideFigures(300.0, 3000.0, 9000.0, 10.0, 600 * MIB, 300 * MIB, 0.5)
    theirs = pg.SideFigures(100.0, 1000.0, 3000.0, 10.0, 400 * MIB, None, 0.25)
    return pg.PointResult(pg.GridPoint(size, n), ours, theirs, ("replayrl", "TRL"), (1.0, 2.0),
                          913_280)


def test_ratios_table_and_plot(tmp_path):
    r = pg.ratios(_result())
    assert r == {"completions/s": pytest.approx(3.0), "generated tokens/s": pytest.approx(3.0),
                 "trainer tokens/s": pytest.approx(3.0), "peak RSS MiB": pytest.approx(1.5),
                 "peak PSS MiB": None}
    table = pg.grid_table([_result()]).splitlines()
    assert len(table) == 3
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[:2] == ["1m (0.9 M)", "2 (10.0 / 10.0)"]
    assert cells[2:5] == ["300", "100", "3.00"]  # completions/s
    assert cells[11:14] == ["600", "400", "1.50"]  # peak RSS MiB
    assert cells[14:17] == ["300", "n/a", "n/a"]  # peak PSS: TRL's missing
    assert cells[17:] == ["0.500", "0.250", "1.0 -> 2.0"]
    png = pg.plot_ratios([_result("1m", 2), _result("1m", 64), _result("10m", 2)], tmp_path / "g.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tree_memory_sums_a_process_tree_from_a_fake_proc(tmp_path):
    # 10 -> 11 -> 12 and 10 -> 13; 20 is not in the tree
    tree = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1}
    for pid, ppid in tree.items():
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (python -m x) S {ppid} 0 0\n")
        (d / "status").write_text(f"Name:\tx\nVmRSS:\t    {pid} kB\n")
        (d / "smaps_rollup").write_text(f"Rss: {pid} kB\nPss:    {pid // 2} kB\n")
    (tmp_path / "self").mkdir()
    assert tm.parent_map(tmp_path) == tree
    assert sorted(tm.descendants(10, tree)) == [10, 11, 12, 13]
    assert tm.tree_usage(10, tmp_path) == ((10 + 11 + 12 + 13) * 1024, (5 + 5 + 6 + 6) * 1024)
    assert tm.tree_usage(99, tmp_path) == (0, 0)  # gone: nothing to read


def test_backward_threads_for_every_point_or_per_model_size():
    from replayrl.tools.bench.peer import parse_backward_threads

    assert parse_backward_threads(None) is None and parse_backward_threads("2") == 2
    assert parse_backward_threads("10m=2, 50m=3") == {"10m": 2, "50m": 3}
    for bad in ("two", "2m=2", "10m=x", "10m=2,10m=3", "-1", "\u00b2", "1m=\u00b2"):
        with pytest.raises(ValueError):
            parse_backward_threads(bad)


def test_each_point_runs_with_its_model_sizes_settings(tmp_path, monkeypatch):
    seen = {}

    def fake_point(point, steps, seed, window, work, trl_first, overrides, replayrl_steps=None):
        seen[(point.model_size, point.answer_tokens)] = overrides
        raise KeyboardInterrupt  # stop after recording the first point's settings

    monkeypatch.setattr(pg, "run_point", fake_point)
    for size in ("1m", "10m"):
        with pytest.raises(KeyboardInterrupt):
            pg.run_grid([pg.GridPoint(size, 2)], 2, [1], 2, tmp_path, {"colocate": True},
                        {"10m": {"trainer-backward-threads": 2}})
    assert seen == {("1m", 2): {"colocate": True},
                    ("10m", 2): {"colocate": True, "trainer-backward-threads": 2}}


def test_per_size_backward_threads_without_a_grid_are_refused(capsys):
    from replayrl.tools.bench.peer import main

    for argv, message in ((["--trainer-backward-threads", "10m=2"], "needs --grid"),
                          (["--grid", "1m:2", "--trainer-backward-threads", "9m=2"], "SIZE=N"),
                          (["--grid", "1m:2", "--trainer-backward-threads", "\u00b2"], "N or SIZE=N")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_grid_settings_are_checked_before_any_point_runs():
    points = pg.parse_grid("1m,10m:2")
    pg.check_points(points, {}, {"10m": {"trainer-backward-threads": 2}})
    with pytest.raises(BenchError, match="names 50m, which the grid does not hold"):
        pg.check_points(points, {}, {"50m": {"trainer-backward-threads": 2}})  # would do nothing
    # refused here, not when the grid reaches the 10m point after running the 1m one
    with pytest.raises(BenchError, match="10m x 2: .*--trainer-backward-threads 2"):
        pg.check_points(points, {"colocate": True}, {"10m": {"trainer-backward-threads": 2}})


@pytest.mark.parametrize("task, std, scale", [
    ({}, " (no std)", "'none' |"),
    # 8 samples: TRL's Bessel-corrected std is sqrt(8 / 7) of the population std, so its
    # advantages are sqrt(7 / 8) = 0.935 of replayrl's
    ({"task": "sort"}, " / (group std + 1e-6), the population std (divides by n)",
     "'group' (group std with Bessel's correction, + 1e-4: its advantages are 0.935x replayrl's at 8 samples"),
])
def test_printed_advantage_follows_the_task_on_both_sides(task, std, scale):
    # the sort task turns GRPO's std normalisation on (rollout/tasks/sort.py): both sides of the
    # printed settings say so, as both sides train with it, each with its own std
    from replayrl.tools.bench.peer import settings_table, trl_settings
    from replayrl.tools.run.from_flags import build_config

    config = build_config(task)
    assert trl_settings(config)["scale_rewards"] == scale.split("'")[1]
    row = next(line for line in settings_table(config).splitlines() if "KL / entropy" in line)
    assert f"reward - group mean{std} |" in row and f"scale_rewards={scale}" in row


def test_model_size_is_refused_with_the_grid_which_sets_it_per_point(capsys):
    from replayrl.tools.bench import peer

    with pytest.raises(SystemExit) as info:
        peer.main(["--model-size", "10m", "--grid", "quick"])
    assert info.value.code == 2
    assert "--model-size with --grid" in capsys.readouterr().err


def test_grid_report_leads_with_time_to_quality_and_writes_both_plots(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from replayrl.tools.bench.peer import run_config
    from replayrl.tools.bench.time_to_quality import time_to_quality

    ours = ((0.1, 0.5, 0.9, 0.9), (1.0, 1.0, 1.0, 1.0))
    theirs = ((0.1, 0.3, 0.8, 1.0), (2.0, 2.0, 2.0, 2.0))
    figures = pg.SideFigures(100.0, 200.0, 300.0, 2.0, None, None, 0.9)

    def fake_point(point, steps, seed, window, work, trl_first, overrides, replayrl_steps=None):
        quality = time_to_quality(*ours, *theirs, window)
        return (pg.PointResult(point, figures, figures, ("replayrl", "TRL"), (1.0, 1.0), 1000,
                               quality, (ours, theirs)),
                run_config(steps, seed, str(work), overrides))

    monkeypatch.setattr(pg, "run_point", fake_point)
    text = pg.run_grid([pg.GridPoint("1m", 2)], 4, [1], 2, tmp_path)
    # threshold 0.9 x (0.8 + 1.0) / 2 = 0.81; ours first reaches a 2-step mean of 0.9 after 4 s
    # (steps 3-4), theirs after 8 s; equal seconds 4: ours 0.9, theirs (0.1 + 0.3) / 2 = 0.2
    assert "| 1m | 2 | 1 | 0.810 | 4.0 | 8.0 | 0.50 | 4.0 | 0.900 | 0.200 |" in text
    assert "Over seeds" not in text  # one seed: no spread table
    assert text.index("Time to quality") < text.index("Settings (first point")
    assert (tmp_path / "peer_grid.png").stat().st_size > 0
    assert (tmp_path / "peer_grid_reward.png").stat().st_size > 0


def test_grid_runs_every_point_at_every_seed_and_prints_the_ratio_of_mean_seconds(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from replayrl.tools.bench.peer import run_config
    from replayrl.tools.bench.time_to_quality import time_to_quality

    # TRL reaches 1.0 at its last step; the threshold is 0.9 x 1.0 on every seed (window 1)
    theirs = ((0.0, 0.0, 1.0), (2.0, 2.0, 2.0))
    ours = {1: ((0.0, 1.0, 1.0), (1.0, 1.0, 1.0)),  # 2 s against 6: 0.33
            2: ((0.0, 0.0, 1.0), (1.0, 1.0, 1.0))}  # 3 s against 6: 0.50
    figures = pg.SideFigures(100.0, 200.0, 300.0, 2.0, None, None, 0.9)
    ran = []

    def fake_point(point, steps, seed, window, work, trl_first, overrides, replayrl_steps=None):
        ran.append((point.answer_tokens, seed, trl_first))
        quality = time_to_quality(*ours[seed], *theirs, window)
        return (pg.PointResult(point, figures, figures, ("replayrl", "TRL"), (1.0, 1.0), 1000,
                               quality, (ours[seed], theirs), seed),
                run_config(steps, seed, str(work), overrides))

    monkeypatch.setattr(pg, "run_point", fake_point)
    text = pg.run_grid([pg.GridPoint("1m", 2), pg.GridPoint("1m", 64)], 3, [1, 2], 1, tmp_path)
    # point by point, each at both seeds; the side that goes first alternates from point to
    # point (the first seed's rates table) and from seed to seed
    assert ran == [(2, 1, False), (2, 2, True), (64, 1, True), (64, 2, False)]
    assert "seeds 1 2" in text.splitlines()[0]
    assert "| 1m | 2 | 2 | 0.900 | 3.0 | 6.0 | 0.50 |" in text  # seed 2's own row
    # mean seconds (2 + 3) / 2 = 2.5 against 6: 0.42
    assert "| 1m | 2 | 1 / 2 | 2.0 / 3.0 | 6.0 / 6.0 | 0.33 / 0.50 | 0.42 |" in text
    assert "| 1m | 64 | 1 / 2 | 2.0 / 3.0 | 6.0 / 6.0 | 0.33 / 0.50 | 0.42 |" in text
    rates = [line for line in text.splitlines() if line.startswith("| 1m (")]
    assert len(rates) == 2  # the rates table: one row per point, the first seed's


def test_a_repeated_seed_is_refused_before_anything_runs(capsys):
    from replayrl.tools.bench.peer import main

    for argv in (["--seeds", "1", "2", "1"], ["--grid", "1m:2", "--seeds", "3", "3"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and "--seeds names a seed twice" in capsys.readouterr().err


def test_a_seed_that_never_reaches_the_threshold_leaves_the_mean_ratio_open():
    from replayrl.tools.bench.time_to_quality import time_to_quality

    figures = pg.SideFigures(1.0, 1.0, 1.0, 2.0, None, None, 0.5)
    theirs = ((0.0, 1.0), (1.0, 1.0))
    never = time_to_quality((0.0, 0.0), (1.0, 1.0), *theirs, 1)
    reached = time_to_quality((1.0, 1.0), (1.0, 1.0), *theirs, 1)
    point = pg.GridPoint("1m", 2)
    rows = [pg.PointResult(point, figures, figures, ("TRL", "replayrl"), (0.0, 0.0), 1, q, (), seed)
            for seed, q in ((1, reached), (2, never))]
    assert pg.seeds_table(rows).splitlines()[-1] == \
        "| 1m | 2 | 1 / 2 | 1.0 / n/a | 2.0 / 2.0 | 0.50 / n/a | n/a |"


def test_replayrl_steps_lengthen_only_replayrls_run_over_the_same_prompt_stream(tmp_path, monkeypatch):
    # time to quality needs the faster side to run the slower side's seconds: --replayrl-steps
    # gives replayrl more steps while TRL keeps --steps, and TRL's prompts stay the stream's
    # first --steps batches (the stream is drawn in order, so the shorter one is its prefix)
    from replayrl.tools.bench import peer
    from replayrl.tools.run import launcher

    seen = {}
    monkeypatch.setattr(launcher, "write_initial_checkpoint", lambda config, path: path)
    monkeypatch.setattr(peer, "_sha256", lambda path: "same")
    monkeypatch.setattr(peer, "run_trl", lambda config, checkpoint, work: seen.setdefault("trl", config))
    monkeypatch.setattr(peer, "run_replayrl", lambda config: seen.setdefault("replayrl", config))
    peer.run_seed(3, 1, tmp_path, trl_first=True, replayrl_steps=7)
    assert (seen["trl"].num_steps, seen["replayrl"].num_steps) == (3, 7)
    short = [p.index for p in peer.prompt_stream(seen["trl"])]
    long = [p.index for p in peer.prompt_stream(seen["replayrl"])]
    b = seen["trl"].rollout.rollout_batch_size
    assert len(short) == 3 * b and len(long) == 7 * b and long[:3 * b] == short


def _two_seed_report(tmp_path, ours_rewards: tuple, trl_rewards: tuple) -> str:
    """bench peer's printed report of two identical seeds: replayrl's run with
    ``ours_rewards`` (1 s steps) against TRL's with ``trl_rewards`` (2 s steps), full batches."""
    from replayrl.tools.bench.peer import report, run_config

    config = run_config(len(ours_rewards), 1, str(tmp_path))
    per_step = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
    ours = SideRun("replayrl", 1, (1.0,) * len(ours_rewards), ours_rewards,
                   (per_step,) * len(ours_rewards))
    theirs = SideRun("TRL", 1, (2.0,) * len(trl_rewards), trl_rewards, (per_step,) * len(trl_rewards))
    facts = {"order": ["replayrl", "TRL"], "config": config}
    return report([(ours, theirs, facts), (ours, theirs, facts)], None, 10)


def test_a_report_of_more_replayrl_steps_compares_only_the_windows_both_sides_ran(tmp_path):
    # --replayrl-steps 20 against TRL's 10: both sides' windows are placed over the 10 steps
    # both ran, which is the one window 1-10. The per-seed and the spread tables keep it (its
    # means worked out by hand), never a window TRL did not run.
    text = _two_seed_report(tmp_path, tuple(0.1 * (i % 2) for i in range(20)), (0.3,) * 10)
    assert "| reward, steps 1-10 | 0.050 | 0.300 | 0.17 |" in text
    assert "| reward, steps 1-10 | 0.050 - 0.050 (0.050) | 0.300 - 0.300 (0.300) | 0.17 | no |" in text
    assert "steps 11-20" not in text and "steps 6-15" not in text


def test_a_longer_replayrl_run_reports_the_windows_over_the_steps_both_ran(tmp_path):
    # TRL 40 steps, replayrl 80: both report the windows of a 40-step run, 1-10 / 11-20 /
    # 21-30 / 31-40 (ends 10, 10, 20, 30, 40), replayrl's means over its own first 40 steps
    text = _two_seed_report(tmp_path, tuple(i / 100 for i in range(80)), (0.5,) * 40)
    # steps 31-40 of replayrl: rewards 0.30 .. 0.39, mean 0.345; TRL 0.5; ratio 0.69
    assert "| reward, steps 31-40 | 0.345 | 0.500 | 0.69 |" in text
    assert "| reward, steps 11-20 | 0.145 - 0.145 (0.145) | 0.500 - 0.500 (0.500) | 0.29 | no |" in text
    assert "steps 71-80" not in text and "steps 41-50" not in text


def test_the_printed_advantage_ratio_is_trls_own_std_against_ours():
    # one group of 8 hand rewards through TRL's std (trl.trainer.utils.nanstd, + 1e-4 as its
    # GRPOTrainer adds) and through replayrl's grpo_advantages: the factor the table prints
    import torch

    pytest.importorskip("trl")
    from trl.trainer.utils import nanstd

    from replayrl.trainer.loss.advantages import grpo_advantages

    rewards = torch.tensor([0.0, 1.0, 0.6, 0.25, 1.0, 0.0, 0.75, 0.3])  # none at the mean
    theirs = (rewards - rewards.mean()) / (nanstd(rewards.view(1, 8), dim=1) + 1e-4)
    ours = grpo_advantages(rewards, 8, normalize_std=True)
    assert torch.allclose(theirs / ours, torch.full((8,), 0.935), atol=5e-4)
