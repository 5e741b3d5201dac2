"""Run outputs beside metrics.jsonl: TensorBoard events and the copyable own-data example."""
from __future__ import annotations

import importlib.util
import json

import pytest

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.rollout.text.prompt_data import load_run_prompts
from replayrl.rollout.text.tokenizer import load_tokenizer
from replayrl.tools.run.metrics import MetricsRecorder
from tests.paths import REPO


def test_tensorboard_events_hold_every_numeric_metric(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [{"step": 0, "reward_mean": 0.25, "eval/x/pass@1": 0.5, "skip_reason": "none"},
            {"step": 1, "reward_mean": 0.75, "support_entropy_mean": 1.5}]
    with MetricsRecorder(tmp_path, 2, show_progress=False, tensorboard=True) as rec:
        for r in rows:
            rec.record(r)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert got["reward_mean"] == [(0, 0.25), (1, 0.75)]
    assert got["eval/x/pass@1"] == [(0, 0.5)] and got["support_entropy_mean"] == [(1, 1.5)]
    assert "skip_reason" not in got


def test_the_example_writes_a_checkpoint_and_prompts_the_run_can_read(tmp_path):
    spec = importlib.util.spec_from_file_location("make_data", REPO / "examples/own_data/make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    a, b = int(first["prompt"].split()[4]), int(first["prompt"].split()[6])
    assert first["label"] == str(max(a, b) if "larger" in first["prompt"] else min(a, b))
    ckpt = tmp_path / "checkpoint"
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    assert model.config.model_type == "qwen3_moe"
    tok = load_tokenizer(ckpt, apply_chat_template=True)
    assert tok.eos_token_ids == (tok.tokenizer.convert_tokens_to_ids("<eos>"),)
    prompts = load_run_prompts(RolloutConfig(prompt_data=str(tmp_path / "train.jsonl"),
                                             apply_chat_template=True), tok,
                               vocab_size=len(VOCABULARY), max_positions=256)
    words = ["<bos>", *first["prompt"].split(), "answer", ":"]
    assert prompts.train[0].prompt_ids.tolist() == tok.tokenizer.convert_tokens_to_ids(words)


def test_a_resumed_run_keeps_the_earlier_rows_before_its_checkpoint(tmp_path):
    earlier = [{"step": s, "reward_mean": s / 10} for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    # resumed from the checkpoint after 2 steps: steps 2.. are trained again, so their old rows go
    with MetricsRecorder(tmp_path, 3, show_progress=False, resume_step=2) as recorder:
        recorder.record({"step": 2, "reward_mean": 0.9})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == earlier[:2] + [{"step": 2, "reward_mean": 0.9}] == recorder.rows
    with MetricsRecorder(tmp_path, 1, show_progress=False) as fresh:  # not a resume: empty
        pass
    assert (tmp_path / "metrics.jsonl").read_text() == "" and fresh.rows == []


def test_a_failing_metrics_hook_is_named_with_its_step_and_traceback(tmp_path):
    from replayrl.tools.errors import MetricsHookError

    def failing_logger(config, metrics):
        raise RuntimeError("hook boom")

    with MetricsRecorder(tmp_path, 2, show_progress=False, hooks=[failing_logger]) as recorder:
        with pytest.raises(MetricsHookError) as err:
            recorder.record({"step": 3, "reward_mean": 0.5})
    message = str(err.value)
    assert message.startswith("--metrics-hook tests.unit.tools.test_outputs:") and "failing_logger" in message
    assert "raised on step 3: RuntimeError: hook boom" in message
    assert 'raise RuntimeError("hook boom")' in message  # the hook's own frame
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "reward_mean": 0.5}
