"""``replayrl bench peer``: its summary arithmetic against hand-computed values, and (when TRL is
installed) a two-step run of both sides on tiny settings."""
from __future__ import annotations

import re

import pytest

from replayrl.tools.bench import peer as bp


def test_median_and_warmup_by_hand():
    assert bp.median([3.0, 1.0, 2.0]) == 2.0
    assert bp.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError):
        bp.median([])
    # first 10 %, at least one step once there are two
    assert [bp.warmup_steps(n) for n in (1, 2, 9, 10, 25, 100)] == [0, 1, 1, 1, 2, 10]


def test_completions_per_second_uses_steady_state_median():
    # 10 steps: the first (5 s) is warm-up; median of the other nine is 0.5 s
    seconds = [5.0, 0.4, 0.6, 0.5, 0.5, 0.9, 0.3, 0.5, 0.7, 0.5]
    assert bp.completions_per_second(seconds, 128) == pytest.approx(128 / 0.5)
    assert bp.completions_per_second([2.0], 8) == pytest.approx(4.0)  # one step: no warm-up


def test_seconds_to_threshold_by_hand():
    rewards = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    seconds = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # window 3: means 0.2, 0.4, 0.6 (steps 1-3, 2-4, 3-5); 0.5 first reached at step 5
    assert bp.seconds_to_threshold(rewards, seconds, 0.5, window=3) == pytest.approx(15.0)
    # exactly at the threshold counts: window 2 at steps 2-3 has mean 0.3
    assert bp.seconds_to_threshold(rewards, seconds, 0.3, window=2) == pytest.approx(6.0)
    assert bp.seconds_to_threshold(rewards, seconds, 0.95, window=3) is None
    assert bp.seconds_to_threshold(rewards[:2], seconds[:2], 0.0, window=3) is None  # no full window
    with pytest.raises(ValueError):
        bp.seconds_to_threshold(rewards, seconds[:-1], 0.5)


def test_report_windows_and_means_by_hand():
    assert bp.report_windows(100) == [(1, 10), (16, 25), (41, 50), (66, 75), (91, 100)]
    # 20 steps: 25 % and 50 % end at step 10 (5 is raised to a full window), 75 % at 15
    assert bp.report_windows(20) == [(1, 10), (6, 15), (11, 20)]
    assert bp.report_windows(4) == [(1, 4)]
    rewards = [0.1, 0.2, 0.3, 0.6]
    assert bp.window_mean(rewards, 2, 4) == pytest.approx((0.2 + 0.3 + 0.6) / 3)
    with pytest.raises(ValueError):
        bp.window_mean(rewards, 3, 5)


def test_ratio_spread_overlap_by_hand():
    assert bp.ratio(3.0, 1.5) == pytest.approx(2.0)
    assert bp.ratio(None, 1.0) is None and bp.ratio(1.0, None) is None and bp.ratio(1.0, 0.0) is None
    assert bp.spread([0.5, 0.2, 0.8]) == pytest.approx((0.2, 0.8, 0.5))
    assert bp.spread([0.5, None]) is None
    assert bp.overlap((0.2, 0.5, 0.3), (0.5, 0.9, 0.7)) is True
    assert bp.overlap((0.2, 0.4, 0.3), (0.5, 0.9, 0.7)) is False
    assert bp.overlap(None, (0.5, 0.9, 0.7)) is None


def test_summarize_by_hand_and_refuses_uneven_batches():
    run = bp.SideRun("x", 1, step_seconds=(4.0, 1.0, 3.0), rewards=(0.0, 1.0, 1.0),
                     completions=(6, 6, 6))
    s = bp.summarize(run, threshold=1.0, window=2)
    assert s.completions_per_second == pytest.approx(6 / 2.0)  # median of 1.0 and 3.0
    assert s.seconds_to_threshold == pytest.approx(8.0)  # steps 2-3 reach mean 1.0
    assert s.reward_windows == {"1-2": pytest.approx(0.5), "2-3": pytest.approx(1.0)}
    with pytest.raises(bp.PeerBenchError, match="completions per step vary"):
        bp.summarize(bp.SideRun("x", 1, (1.0, 1.0), (0.0, 0.0), (6, 5)), 0.5, 1)


def test_trl_settings_match_the_run_config():
    config = bp.run_config(7, 3, "unused", {"rollout-batch-size": 3, "n-samples-per-prompt": 5})
    k = bp.trl_settings(config)
    # one optimizer step per generation batch of 3 x 5 completions
    assert k["per_device_train_batch_size"] * k["gradient_accumulation_steps"] == 15
    assert k["num_generations"] == 5 and k["steps_per_generation"] == 1 and k["num_iterations"] == 1
    assert (k["learning_rate"], k["adam_beta1"], k["adam_beta2"]) == (3e-4, 0.9, 0.98)
    assert (k["epsilon"], k["epsilon_high"], k["beta"]) == (0.2, 0.28, 0.0)
    assert k["scale_rewards"] == "none" and k["max_steps"] == 7 and k["seed"] == 3
    assert (k["max_completion_length"], k["top_k"], k["temperature"]) == (2, 20, 1.0)
    # replayrl's own recipe keeps its entropy bonus; --same-objective trains TRL's loss (none)
    assert config.trainer.entropy_coef == 0.05
    assert bp.run_config(7, 3, "unused", bp.SAME_OBJECTIVE).trainer.entropy_coef == 0.0


def test_prompt_stream_is_the_managers_and_indexer_keeps_every_key():
    config = bp.run_config(3, 2, "unused", {"rollout-batch-size": 4})
    stream = bp.prompt_stream(config)
    assert len(stream) == 12 and all(len(p.prompt_ids) == 7 for p in stream)
    # 7 prompt tokens + 2 new: the last trained logit's query sees 8 keys = index_topk
    assert bp.indexer_is_dense(config)
    assert not bp.indexer_is_dense(bp.run_config(3, 2, "unused", {"num-digits": 6}))


def test_the_entropy_baseline_reaches_replayrls_side_and_its_settings_row(capsys):
    config = bp.run_config(7, 3, "unused", {"entropy-baseline": True})
    assert config.trainer.entropy_baseline and not bp.run_config(7, 3, "unused").trainer.entropy_baseline
    assert "centred on the step's mean surprisal" in bp.settings_table(config)
    assert "centred" not in bp.settings_table(bp.run_config(7, 3, "unused"))
    # with TRL's objective there is no bonus to centre: refused before anything runs
    with pytest.raises(SystemExit):
        bp.main(["--same-objective", "--entropy-baseline", "--steps", "1"])
    assert "--same-objective turns off" in capsys.readouterr().err


def test_the_entropy_warmup_reaches_replayrls_side_and_its_settings_row(capsys):
    config = bp.run_config(7, 3, "unused", {"entropy-coef-warmup-steps": 10})
    assert config.trainer.entropy_coef_warmup_steps == 10
    assert "rising linearly over the first 10 steps" in bp.settings_table(config)
    assert "rising" not in bp.settings_table(bp.run_config(7, 3, "unused"))
    with pytest.raises(SystemExit):
        bp.main(["--same-objective", "--entropy-coef-warmup-steps", "10", "--steps", "1"])
    assert "--same-objective turns off" in capsys.readouterr().err


def test_the_dense_model_puts_replayrl_on_the_function_trls_model_computes(capsys):
    # 64 new tokens of the sort task: 65 prompt tokens + 63 = 128 keys for the last trained
    # logit, far above the embedded indexer's 8, so by default the two sides differ
    long = {"task": "sort", "answer-tokens": 63, "rollout-max-response-len": 64}
    sparse = bp.run_config(3, 2, "unused", long)
    assert sparse.policy_config.index_topk == 8 and not bp.indexer_is_dense(sparse)
    dense = bp.run_config(3, 2, "unused", {**long, **bp.DENSE_MODEL})
    assert dense.policy_config.index_topk == 0 and bp.indexer_is_dense(dense)
    rows = {c: next(line for line in bp.settings_table(c).splitlines() if "policy / logprobs" in line)
            for c in (sparse, dense)}
    assert "routing / indexer replay" in rows[sparse] and "no indexer: --no-model-indexer" in rows[dense]
    # the std normalisation of the sort task, with the trainer's epsilon as it prints
    assert "reward - group mean / (group std + 1e-6), the population std" in bp.settings_table(sparse)
    # no indexer, no indexer drift to measure
    assert "indexer_drift_rate" in bp.settings_table(sparse)
    assert "indexer_drift_rate" not in bp.settings_table(dense)
    # the flags are the bench's: parsed, then the repeated seed is what stops them
    for flag in ("--dense-model", "--sparse-model"):
        with pytest.raises(SystemExit):
            bp.main([flag, "--seeds", "1", "1"])
        assert "names a seed twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bp.main(["--dense-model", "--sparse-model"])
    assert "not allowed with" in capsys.readouterr().err


def test_by_default_the_sides_train_one_function_at_every_length():
    # 2 new tokens: 7 + 2 - 1 = 8 keys, the indexer keeps them all: the model stays as it is
    assert bp.same_function(3, 2, {}) == {}
    # 64 new tokens: 128 keys against 8: replayrl's side drops the indexer
    long = {"task": "sort", "answer-tokens": 63, "rollout-max-response-len": 64}
    resolved = bp.same_function(3, 2, long)
    assert resolved == {**long, "model-indexer": False}
    assert bp.run_config(3, 2, "unused", resolved).policy_config.index_topk == 0
    # --dense-model / --sparse-model are kept as given, at either length
    for given in (bp.DENSE_MODEL, bp.SPARSE_MODEL):
        assert bp.same_function(3, 2, {**long, **given}) == {**long, **given}
        assert bp.same_function(3, 2, given) == given
    assert bp.run_config(3, 2, "unused", {**long, **bp.SPARSE_MODEL}).policy_config.index_topk == 8
    # and the reports say which of the three cases a run is
    phrases = [bp.function_compared(bp.run_config(3, 2, "unused", o))
               for o in ({}, resolved, {**long, **bp.SPARSE_MODEL})]
    assert "keeps all of them" in phrases[0] and "has no indexer" in phrases[1]
    assert "the sparse one (--sparse-model)" in phrases[2]


def test_missing_trl_names_the_extra(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "trl" else real(name, *a))
    assert bp.main(["--steps", "1"]) == 2
    assert "replayrl[bench]" in capsys.readouterr().err


def test_two_steps_of_both_sides():
    pytest.importorskip("trl")
    batch, n, steps = 2, 4, 2
    text = bp.bench(steps, [1], threshold=0.5, window=10,
                    overrides={"rollout-batch-size": batch, "n-samples-per-prompt": n})
    assert "| setting | replayrl | TRL GRPOTrainer |" in text
    assert "ignores the DSA indexer weights" in text
    m = re.search(r"completions per step: replayrl (\d+), TRL (\d+)", text)
    assert m and int(m.group(1)) == int(m.group(2)) == batch * n
    for figure in ("completions/s", "median step seconds", "total step seconds",
                   f"reward, steps 1-{steps}"):
        row = re.search(rf"^\| {re.escape(figure)} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                        text, re.M)
        assert row, figure
        ours, theirs, r = (float(g) for g in row.groups())
        if figure == "completions/s":  # printed to 0.1 (ratio to 0.01): bound the rounding
            assert (ours - 0.05) / (theirs + 0.05) - 0.005 <= r <= (ours + 0.05) / (theirs - 0.05) + 0.005
    assert "| step seconds to 10-step mean reward >= 0.500 | not reached | not reached | n/a |" in text
