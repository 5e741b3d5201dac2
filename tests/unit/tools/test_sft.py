"""``replayrl sft`` in process on a tiny transformers-written checkpoint (tests/chat_checkpoint.py):
bad rows refused or skipped (named by file and line, counted), the loss falling on a
memorisable set, and a resumed run continuing exactly."""
from __future__ import annotations

import json

import numpy as np
import pytest

from replayrl.rollout.text.conversation import ConversationError
from replayrl.rollout.text.tokenizer import load_tokenizer
from replayrl.tools.sft.config import build_sft_config
from replayrl.tools.sft.data import load_conversations
from replayrl.tools.sft.loop import batch_indices, run_sft
from tests.chat_checkpoint import write_chat_checkpoint

GOOD = {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]}
ROWS = [GOOD,
        {"messages": [{"role": "user", "content": "hi"}]},                                # no assistant
        {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},  # unknown role
        {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}]},
        {"prompt": "no messages"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("sft_ckpt"))


@pytest.fixture
def bad_file(tmp_path):
    path = tmp_path / "data.jsonl"
    # a blank line is not a row: the line numbers below count it
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + "\n".join(json.dumps(r) for r in ROWS[1:]) + "\n")
    return path


def test_a_bad_row_is_refused_naming_its_file_and_line(checkpoint, bad_file):
    tok = load_tokenizer(checkpoint, apply_chat_template=True)
    with pytest.raises(ConversationError, match=f"{bad_file}:3: no assistant message"):
        load_conversations([bad_file], tok, max_length=200, vocab_size=10 ** 6, skip_bad_rows=False)


def test_skip_bad_rows_counts_and_names_every_bad_row(checkpoint, bad_file):
    tok = load_tokenizer(checkpoint, apply_chat_template=True)
    data = load_conversations([bad_file], tok, max_length=200, vocab_size=10 ** 6, skip_bad_rows=True)
    assert data.sources == (f"{bad_file}:1",)
    assert [where for where, _ in data.skipped] == [f"{bad_file}:{n}" for n in (3, 4, 5, 6)]
    assert data.skipped_by_reason == {"no_assistant": 1, "unknown_role": 1, "too_long": 1, "malformed": 1}
    assert all(message.startswith(where) for where, message in data.skipped)


def test_batches_walk_a_fresh_permutation_on_every_pass():
    rows, size = 5, 3
    seen = np.concatenate([batch_indices(s, size, rows, seed=4) for s in range(5)])  # 3 passes
    for e in range(3):
        assert sorted(seen[e * rows:(e + 1) * rows]) == list(range(rows))
        assert list(seen[e * rows:(e + 1) * rows]) == list(np.random.default_rng([4, e]).permutation(rows))


def _memorisable(path):
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in (("ab", "7"), ("cd", "9"))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(checkpoint, tmp_path, name, **flags):
    values = {"hf-checkpoint": str(checkpoint), "data": [str(_memorisable(tmp_path / "m.jsonl"))],
              "batch-size": 2, "lr": 0.01, "progress": False, "output-dir": str(tmp_path / name),
              **flags}
    return run_sft(build_sft_config(values))


def test_the_loss_falls_on_a_memorisable_set(checkpoint, tmp_path):
    result = _run(checkpoint, tmp_path, "run", **{"num-steps": 30})
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(30))
    # every step trains both conversations: their assistant tokens "7<|im_end|>", "9<|im_end|>"
    assert {r["loss_tokens"] for r in rows} == {4}
    # a random policy over ~100 tokens starts near ln(100) = 4.6 nats; memorised, far below
    assert rows[0]["loss"] > 3.5 and rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert result.plot_path.is_file() and "loss first10%" in result.summary


def test_a_resumed_run_continues_exactly(checkpoint, tmp_path):
    whole = _run(checkpoint, tmp_path, "whole", **{"num-steps": 4})
    _run(checkpoint, tmp_path, "half", **{"num-steps": 2, "save-interval": 2})
    resumed = _run(checkpoint, tmp_path, "half", **{"num-steps": 4,
                                                    "load": str(tmp_path / "half/checkpoints/step-2")})
    keys = ("step", "loss", "grad_norm", "loss_tokens")
    a = [{k: json.loads(x)[k] for k in keys} for x in whole.metrics_path.read_text().splitlines()]
    b = [{k: json.loads(x)[k] for k in keys} for x in resumed.metrics_path.read_text().splitlines()]
    assert a == b


def test_fsdp_on_one_rank_trains_as_the_torch_backend(checkpoint, tmp_path):
    # the same update sharded over a one-rank group: the same losses, step for step
    import torch.distributed as dist

    try:
        runs = {backend: _run(checkpoint, tmp_path, backend, **{"num-steps": 3, "train-backend": backend})
                for backend in ("torch", "fsdp")}
    finally:  # the fsdp backend made a one-rank group in this process: not for later tests
        if dist.is_initialized():
            dist.destroy_process_group()
    losses = {b: [json.loads(x)["loss"] for x in r.metrics_path.read_text().splitlines()]
              for b, r in runs.items()}
    assert losses["fsdp"] == pytest.approx(losses["torch"], rel=1e-5)
    assert losses["torch"][2] < losses["torch"][0]


def test_parquet_rows_render_as_their_jsonl_rows(checkpoint, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet needs the parquet extra")
    import pyarrow as pa

    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2+3"}}}
    rows = [GOOD, {"messages": [{"role": "user", "content": "2+3?"},
                                {"role": "assistant", "content": "", "tool_calls": [call]},
                                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "d.parquet"))
    tok = load_tokenizer(checkpoint, apply_chat_template=True)
    a, b = (load_conversations([tmp_path / f"d.{ext}"], tok, max_length=512, vocab_size=10 ** 6,
                               skip_bad_rows=False) for ext in ("jsonl", "parquet"))
    assert b.sources == (f"{tmp_path / 'd.parquet'}:1", f"{tmp_path / 'd.parquet'}:2")
    for x, y in zip(a.conversations, b.conversations):
        assert x.response_ids.tolist() == y.response_ids.tolist()
        assert x.loss_mask.tolist() == y.loss_mask.tolist()


def test_the_command_exits_2_naming_the_bad_row(checkpoint, bad_file, tmp_path, capsys):
    from replayrl.tools.cli import main

    assert main(["sft", "--hf-checkpoint", str(checkpoint), "--data", str(bad_file),
                 "--no-progress", "--output-dir", str(tmp_path / "run")]) == 2
    assert f"configuration error: {bad_file}:3: no assistant message" in capsys.readouterr().err


def test_the_loss_is_the_token_mean_of_the_step_whatever_the_microbatches(checkpoint, tmp_path):
    whole = _run(checkpoint, tmp_path, "whole", **{"num-steps": 3})
    split = _run(checkpoint, tmp_path, "split", **{"num-steps": 3, "micro-batch-size": 1})
    rows = [[json.loads(x) for x in r.metrics_path.read_text().splitlines()] for r in (whole, split)]
    for a, b in zip(*rows):  # the same update: equal losses and gradient norms, step for step
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
