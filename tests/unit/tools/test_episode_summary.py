"""A multi-turn run's per-episode figures in the summary line and the plot
(tools/run/metrics.py), from rows whose values are chosen by hand."""
from __future__ import annotations

from replayrl.tools.run.metrics import MetricsRecorder, episode_summary

# ten steps: turns 1 -> 2, one unreadable call per two trajectories in the last step, an
# environment failure in steps 0 and 9, accuracy 0.1 * step
ROWS = [{"step": s, "reward_mean": 0.1 * s, "step_seconds": 0.5, "response_len_mean": 8.0,
         "turns_mean": 1.0 + 0.1 * s,
         "tool_calls_mean": 0.1 * s, "parse_errors_mean": 0.5 if s == 9 else 0.0,
         "env_failures": 1 if s in (0, 9) else 0, "final_answer_accuracy": 0.1 * s}
        for s in range(10)]


def test_the_summary_line_shows_the_episode_figures(tmp_path):
    # the last 10 % of ten steps is step 9; the first 10 % step 0
    assert episode_summary(ROWS) == ("turns last10%=1.90  tool calls last10%=0.90  "
                                     "parse errors last10%=0.50  env failures=2  "
                                     "accuracy first10%=0.000 last10%=0.900  ")
    with MetricsRecorder(tmp_path, num_steps=10, show_progress=False) as recorder:
        for row in ROWS:
            recorder.record(row)
    assert "entropy last10%=n/a  trace B/token=n/a  turns last10%=1.90  " in recorder.summary()
    assert recorder.summary().endswith(f"accuracy first10%=0.000 last10%=0.900  metrics={recorder.path}")
    assert recorder.plot().is_file()


def test_a_single_turn_run_has_no_episode_figures():
    rows = [{"step": 0, "reward_mean": 0.5, "step_seconds": 0.1}]
    assert episode_summary(rows) == ""
    # no --env: no parser and no environment failures, the rest shown
    rows = [{"step": 0, "reward_mean": 0.5, "turns_mean": 2.0, "tool_calls_mean": 1.0,
             "final_answer_accuracy": 0.25}]
    assert episode_summary(rows) == ("turns last10%=2.00  tool calls last10%=1.00  "
                                     "accuracy first10%=0.250 last10%=0.250  ")
