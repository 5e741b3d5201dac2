"""An --output-dir that holds a run is refused before start unless resumed or overwritten
(tools/run/output_dir.py), in one line with exit code 2."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.output_dir import check_output_dir, clear_run


def _earlier_run(out: Path, steps: tuple[int, ...] = ()) -> None:
    """What a finished run leaves: metrics, plot, record, and checkpoints step-N."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "reward.png").write_bytes(b"png")
    (out / "config.json").write_text("{}")
    (out / "tensorboard").mkdir()
    for n in steps:
        (out / "checkpoints" / f"step-{n}").mkdir(parents=True)
        (out / "checkpoints" / f"step-{n}" / "run_state.json").write_text(f'{{"next_step": {n}}}')


def _config(out: Path, **flags):
    return build_config({"output-dir": str(out), **flags})


def test_a_fresh_or_empty_directory_is_taken(tmp_path):
    check_output_dir(_config(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    check_output_dir(_config(tmp_path / "empty"))


def test_a_directory_with_a_run_is_refused_saying_what_to_add(tmp_path):
    out = tmp_path / "run"
    _earlier_run(out, steps=(2, 10))
    with pytest.raises(ConfigError) as info:
        check_output_dir(_config(out))
    latest = out / "checkpoints" / "step-10"  # by number, not by name: step-2 sorts after it
    assert str(info.value) == (f"--output-dir {out} already holds a run (metrics.jsonl, 2 "
                               f"checkpoint(s) in {out / 'checkpoints'}); add --load {latest} to "
                               f"resume it, --overwrite to replace it, or give another --output-dir")


def test_metrics_alone_or_checkpoints_alone_make_a_run(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match=r"\(metrics.jsonl\); add --overwrite to replace it"):
        check_output_dir(_config(tmp_path / "metrics"))
    (tmp_path / "ckpt" / "checkpoints" / "step-1.partial").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"1 checkpoint\(s\)"):  # killed while saving
        check_output_dir(_config(tmp_path / "ckpt"))


def test_a_run_stopped_before_its_first_step_is_no_run(tmp_path):
    """Ctrl-C during start-up leaves an empty metrics.jsonl (and checkpoint-init, config.json):
    the same command again is taken, not refused."""
    out = tmp_path / "stopped"
    out.mkdir()
    (out / "metrics.jsonl").write_text("\n")
    (out / "config.json").write_text("{}")
    (out / "checkpoint-init").mkdir()
    check_output_dir(_config(out))


def test_resuming_one_of_its_checkpoints_or_overwriting_is_allowed(tmp_path):
    out = tmp_path / "run"
    _earlier_run(out, steps=(3,))
    check_output_dir(_config(out, load=str(out / "checkpoints" / "step-3")))
    check_output_dir(_config(out, overwrite=True))
    # a checkpoint under --save elsewhere is this run's too
    save = tmp_path / "saves"
    (save / "step-1").mkdir(parents=True)
    (save / "step-1" / "run_state.json").write_text('{"next_step": 1}')
    check_output_dir(_config(out, save=str(save), load=str(save / "step-1")))


def test_a_checkpoint_of_another_run_does_not_make_it_a_resume(tmp_path):
    out, other = tmp_path / "run", tmp_path / "other"
    _earlier_run(out)
    _earlier_run(other, steps=(4,))
    with pytest.raises(ConfigError, match="already holds a run"):
        check_output_dir(_config(out, load=str(other / "checkpoints" / "step-4")))


def test_overwrite_refuses_to_delete_the_checkpoint_it_would_load(tmp_path):
    out = tmp_path / "run"
    _earlier_run(out, steps=(3,))
    with pytest.raises(ConfigError, match="--overwrite would delete .* drop --overwrite to resume"):
        check_output_dir(_config(out, overwrite=True, load=str(out / "checkpoints" / "step-3")))


def test_overwrite_clears_the_runs_files_and_nothing_else(tmp_path):
    out = tmp_path / "run"
    _earlier_run(out, steps=(1, 2))
    (out / "notes.txt").write_text("the user's own")
    gone = clear_run(_config(out, overwrite=True))
    assert sorted(p.relative_to(out).as_posix() for p in gone) == [
        "checkpoints/step-1", "checkpoints/step-2", "metrics.jsonl", "reward.png", "tensorboard"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.json", "notes.txt"]
    check_output_dir(_config(out))  # no run left: a plain start is taken


def test_overwrite_is_not_recorded_as_a_setting_to_repeat(tmp_path):
    assert json.loads(_config(tmp_path, overwrite=True).to_json())["overwrite"] is False


def test_replayrl_train_refuses_in_one_line_with_exit_code_2(tmp_path, capsys):
    from replayrl.tools import cli

    _earlier_run(tmp_path / "run")
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main(["train", "--output-dir", str(tmp_path / "run")])
    finally:  # `replayrl train` turns SIGTERM into an exception: not for the rest of the session
        signal.signal(signal.SIGTERM, sigterm)
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [f"replayrl: configuration error: --output-dir {tmp_path / 'run'} "
                                f"already holds a run (metrics.jsonl); add --overwrite to replace "
                                f"it, or give another --output-dir"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 0}\n'  # untouched
