"""The real multi-process system on a user's prompt file: chat template, --rm-type exact,
evaluation, checkpoint and resume; and the errors a user's data or reward can cause."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from replayrl.actors import RemoteError
from replayrl.rollout.tasks.digit_puzzle import DigitTask
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import launch, write_initial_checkpoint

TEMPLATE = ("{{ bos_token }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %} ={% endif %}")
SMALL = {"rollout-batch-size": 4, "n-samples-per-prompt": 4, "progress": False}


def _user_files(root: Path) -> dict:
    """A tokenizer directory with a chat template and prompt files in the common
    {"prompt", "label"} shape, made from the digit task's words (the embedded model's)."""
    tok = write_initial_checkpoint(build_config({}), root / "tok")
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    task = DigitTask(num_digits=3, num_values=5)
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(40):
        ids, answer = task.make_prompt(rng)
        rows.append({"prompt": task.decode(ids[1:-1]), "label": task.vocabulary[answer]})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[32:]))
    return {"tokenizer": str(tok), "prompt-data": str(root / "train.jsonl"),
            "apply-chat-template": True, "rm-type": "exact", "rollout-max-response-len": 2,
            "eval-prompt-data": ("held-out", str(root / "test.jsonl")),
            "n-samples-per-eval-prompt": 4, "eval-interval": 10}


def _rows(result) -> list[dict]:
    return [json.loads(line) for line in result.metrics_path.read_text().splitlines()]


async def test_twenty_steps_on_a_prompt_file_then_resume_from_the_checkpoint(tmp_path):
    user = _user_files(tmp_path)
    first = await launch(build_config({**SMALL, **user, "num-steps": 20, "save-interval": 10,
                                       "output-dir": str(tmp_path / "run")}))
    rows = _rows(first)
    assert [r["step"] for r in rows] == list(range(20))
    # exact match gives 0 or 1 per sample; 16 samples per step
    assert all(r["reward_mean"] * 16 == round(r["reward_mean"] * 16) for r in rows)
    # 32 prompts, 4 per step: each epoch of 8 steps visits every prompt once
    for epoch in range(2):
        seen = sum((r["prompt_indices"] for r in rows[8 * epoch:8 * epoch + 8]), [])
        assert sorted(seen) == list(range(32))
    for r in rows:  # entropy over at most top-k = 20 candidates; responses of 1..2 tokens
        assert 0 < r["support_entropy_mean"] <= np.log(20) + 1e-6
        assert 1 <= r["response_len_mean"] <= 2
    evals = [r for r in rows if "eval/held-out/reward_mean" in r]
    assert [r["step"] for r in evals] == [9, 19]
    for r in evals:
        assert 0 <= r["eval/held-out/pass@1"] <= r["eval/held-out/pass@4"] <= 1
    resumed = await launch(build_config({**SMALL, **user, "num-steps": 20,
                                         "load": str(tmp_path / "run" / "checkpoints" / "step-10"),
                                         "output-dir": str(tmp_path / "resumed")}))
    again = _rows(resumed)
    assert [r["step"] for r in again] == list(range(10, 20))
    # the data source resumes at its position: the same prompts, in the same order
    assert [r["prompt_indices"] for r in again] == [r["prompt_indices"] for r in rows[10:]]
    # the first resumed batch comes from the restored weights with the same seeds
    assert again[0]["reward_mean"] == rows[10]["reward_mean"]


async def test_a_bad_row_stops_the_run_before_any_process_starts(tmp_path):
    user = _user_files(tmp_path)
    with open(user["prompt-data"], "a") as f:
        f.write(json.dumps({"prompt": "max 1 2"}) + "\n")
    with pytest.raises(ConfigError, match=r"train\.jsonl:33: missing key 'label'"):
        await launch(build_config({**SMALL, **user, "num-steps": 1,
                                   "output-dir": str(tmp_path / "run")}))
    assert not (tmp_path / "run").exists()  # a new output directory is not left behind
    # an earlier run's directory keeps its initial checkpoint and record untouched
    earlier = tmp_path / "earlier"
    (earlier / "checkpoint-init").mkdir(parents=True)
    (earlier / "checkpoint-init" / "model.safetensors").write_bytes(b"earlier run")
    (earlier / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"train\.jsonl:33: missing key 'label'"):
        await launch(build_config({**SMALL, **user, "num-steps": 1, "seed": 7,
                                   "output-dir": str(earlier)}))
    assert sorted(p.name for p in earlier.iterdir()) == ["checkpoint-init", "config.json"]
    assert (earlier / "checkpoint-init" / "model.safetensors").read_bytes() == b"earlier run"


@pytest.mark.parametrize("values, match", [
    ({"eval-interval": 5}, "--eval-interval needs at least one --eval-prompt-data"),
    ({"eval-prompt-data": ("a", "x.jsonl", "b")}, "--eval-prompt-data must be NAME FILE pairs"),
    ({"eval-prompt-data": ("a", "x.jsonl")}, "--eval-prompt-data is evaluated every --eval-interval"),
    ({"rm-type": "regex"}, "--rm-type must be digits, exact or math"),
    ({"apply-chat-template-kwargs": "[1]"}, "--apply-chat-template-kwargs must be a JSON object"),
    ({"reward-failure": "skip"}, "--reward-failure must be error or zero"),
])
def test_bad_settings_name_the_flag(values, match):
    with pytest.raises(ConfigError, match=match):
        build_config(values)


async def test_the_digits_reward_on_text_labels_is_refused_before_start(tmp_path):
    user = _user_files(tmp_path)
    train = Path(user["prompt-data"])
    lines = train.read_text().splitlines()
    lines[4] = json.dumps({"prompt": json.loads(lines[4])["prompt"], "label": "five"})
    train.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"--rm-type digits needs labels that are one "
                                          r"vocabulary token .*train\.jsonl:5 has the label 'five'"):
        await launch(build_config({**SMALL, **user, "rm-type": "digits", "num-steps": 1,
                                   "output-dir": str(tmp_path / "run")}))
    assert not (tmp_path / "run" / "config.json").exists()  # refused before anything started


async def test_more_steps_than_the_epochs_hold_is_refused(tmp_path):
    user = _user_files(tmp_path)
    with pytest.raises(ConfigError, match="--num-epoch 1 x 32 prompts"):
        await launch(build_config({**SMALL, **user, "num-steps": 9, "num-epoch": 1,
                                   "output-dir": str(tmp_path / "run")}))


async def test_a_reward_over_its_time_limit_stops_the_run_naming_the_sample(tmp_path):
    start = time.monotonic()
    with pytest.raises(RemoteError, match=r"sample \d+ \(prompt .*digits\.jsonl:\d+\): reward "
                                          r"exceeded --reward-timeout-seconds 0.5"):
        await launch(build_config({**SMALL, "num-steps": 2, "output-dir": str(tmp_path),
                                   "custom-reward": "tests.hook_fixtures:slow_reward",
                                   "reward-timeout-seconds": 0.5}))
    assert time.monotonic() - start < 120


def test_resuming_with_another_prompt_file_is_refused(tmp_path):
    saved = build_config({"prompt-data": "a.jsonl"}).data_settings()
    (tmp_path / "run_state.json").write_text(json.dumps({"next_step": 2, "data_settings": saved}))
    with pytest.raises(ConfigError, match="--prompt-data 'a.jsonl' -> 'b.jsonl'"):
        build_config({"prompt-data": "b.jsonl", "load": str(tmp_path)})
