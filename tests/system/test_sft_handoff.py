"""SFT to RL: ``replayrl sft`` a few steps on a transformers-written checkpoint with
``--save-hf``, then ``replayrl train --hf-checkpoint`` that directory for one step (docs/sft.md).
A system test: the train run starts its actor processes."""
from __future__ import annotations

import json

from replayrl.tools.cli import main
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import launch
from tests.chat_checkpoint import write_chat_checkpoint

CALL = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2*3"}}}


async def test_an_sft_checkpoint_is_what_replayrl_train_starts_from(tmp_path):
    checkpoint = write_chat_checkpoint(tmp_path / "ckpt")
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"messages": [
        {"role": "user", "content": "2*3?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}]}) + "\n")
    assert main(["sft", "--hf-checkpoint", str(checkpoint), "--data", str(data), "--num-steps", "3",
                 "--batch-size", "1", "--no-progress", "--output-dir", str(tmp_path / "sft"),
                 "--save-hf", str(tmp_path / "hf")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "2*3?", "label": "6"}) + "\n")
    config = build_config({"hf-checkpoint": str(tmp_path / "hf" / "step-3"), "num-steps": 1,
                           "prompt-data": str(prompts), "apply-chat-template": True, "rm-type": "exact",
                           "rollout-max-response-len": 4, "rollout-batch-size": 1,
                           "n-samples-per-prompt": 2, "progress": False, "seed": 1,
                           "output-dir": str(tmp_path / "rl")})
    result = await launch(config)
    (row,) = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert row["step"] == 0 and row["samples"] == 2
