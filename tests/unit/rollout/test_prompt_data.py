"""Prompt files, the run's tokenizer and the built-in task as data (docs/design/prompt-data.md#prompt-data)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.errors import DataExhausted, PromptDataError, TokenizerError
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY, DigitTask
from replayrl.rollout.tasks.digits import BUILTIN_FILE, digit_task_prompts, digit_task_rows
from replayrl.rollout.text.data_source import PromptDataSource
from replayrl.rollout.text.prompt_data import load_run_prompts, read_rows
from replayrl.rollout.text.tokenizer import load_tokenizer
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint

# renders "<bos> max 3 1 4 2 =" for the user message "max 3 1 4 2", a tool message " = 4"
TEMPLATE = ("{{ bos_token }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %} ={% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The embedded initial checkpoint (its word-level tokenizer), with a chat template."""
    d = write_initial_checkpoint(build_config({}), tmp_path_factory.mktemp("ckpt"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return d


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_shipped_prompt_file_is_the_task_generator_output():
    rows = [json.loads(line) for line in BUILTIN_FILE.read_text().splitlines()]
    assert rows == digit_task_rows(DigitTask(num_digits=4, num_values=5), 1, 4096)
    assert rows[0]["prompt"].startswith("<bos> ") and rows[0]["prompt"].endswith(" =")


def test_builtin_data_gives_todays_prompt_ids_in_todays_order(checkpoint):
    # the reference is the task generator drawing token ids directly (the data source as it
    # was before the built-in task became a text file); the run's path reads the shipped
    # text and encodes it with transformers' AutoTokenizer on the embedded tokenizer
    cfg = RolloutConfig()
    got = load_run_prompts(cfg, load_tokenizer(checkpoint), vocab_size=len(VOCABULARY),
                           max_positions=256)
    task = DigitTask(num_digits=cfg.num_digits, num_values=cfg.num_values)
    for run_prompts, seed in ((got.train, cfg.seed), (got.replacement, cfg.seed + 7919)):
        ref = digit_task_prompts(task, seed, cfg.dataset_size)
        new, old = PromptDataSource(run_prompts, seed), PromptDataSource(ref, seed)
        for n in (16, 4096, 100):  # crosses an epoch boundary
            a, b = new.next_batch(n), old.next_batch(n)
            assert [p.index for p in a] == [p.index for p in b]
            assert all(np.array_equal(x.prompt_ids, y.prompt_ids) and x.answer_id == y.answer_id
                       for x, y in zip(a, b))
    # one prompt by hand: "<bos> min 0 4 2 4 =" is the file's first row
    assert got.train[0].prompt_ids.tolist() == [VOCABULARY.index(w) for w in
                                                "<bos> min 0 4 2 4 =".split()]
    assert got.train[0].label == "0" and got.train[0].answer_id == VOCABULARY.index("0")


def test_jsonl_rows_with_chat_template_labels_and_metadata(checkpoint, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"question": "max 3 1 4 2", "answer": 4, "info": {"id": "a"}},
        "",  # a blank line is not a row, but line numbers keep counting
        {"question": [{"role": "user", "content": "min 3 1"}], "answer": "1"}])
    cfg = RolloutConfig(prompt_data=str(path), input_key="question", label_key="answer",
                        metadata_key="info", apply_chat_template=True)
    tok = load_tokenizer(checkpoint, apply_chat_template=True)
    got = load_run_prompts(cfg, tok, vocab_size=len(VOCABULARY), max_positions=256)
    ids = {w: i for i, w in enumerate(VOCABULARY)}
    assert got.train[0].prompt_ids.tolist() == [ids[w] for w in "<bos> max 3 1 4 2 =".split()]
    assert got.train[1].prompt_ids.tolist() == [ids[w] for w in "<bos> min 3 1 =".split()]
    assert [p.label for p in got.train] == ["4", "1"]
    assert dict(got.train[0].metadata) == {"id": "a"} and dict(got.train[1].metadata) == {}
    assert got.train[1].source == f"{path}:3"
    # transformers itself, tokenising the template's output, as the reference
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(str(checkpoint))
    text = ref.apply_chat_template([{"role": "user", "content": "max 3 1 4 2"}], tokenize=False,
                                   add_generation_prompt=True)
    assert got.train[0].prompt_ids.tolist() == ref(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("line, match", [
    ('{"label": "1"}', r"p\.jsonl:2: missing key 'prompt' \(--input-key\)"),
    ('{"prompt": "max 1 2"}', r"p\.jsonl:2: missing key 'label' \(--label-key\)"),
    ('{"prompt": "max 1 2", "label": [1]}', r"p\.jsonl:2: key 'label' must be a string or a number"),
    ('{"prompt": "max 1 2", "label": "1", "metadata": 3}', r"p\.jsonl:2: key 'metadata' must be a JSON object"),
    ('{"prompt": 7, "label": "1"}', r"p\.jsonl:2: key 'prompt' must be a non-empty string"),
    ('{"prompt": "max 1', r"p\.jsonl:2: not valid JSON"),
    ('[1, 2]', r"p\.jsonl:2: a row must be a JSON object"),
    ('{"prompt": "max 1 2", "label": 1e400}', r"p\.jsonl:2: key 'label' must be finite, got inf"),
    ('{"prompt": "max 1 2", "label": NaN}', r"p\.jsonl:2: key 'label' must be finite, got nan"),
])
def test_a_bad_row_names_file_line_and_key(tmp_path, line, match):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "max 1 2", "label": "2"}, line])
    with pytest.raises(PromptDataError, match=match):
        read_rows(path)


def test_a_line_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "max 1 2", "label": "2"}\n\xff\xfe{"prompt"\n')
    with pytest.raises(PromptDataError, match=r"p\.jsonl:2: not UTF-8 text"):
        read_rows(path)


def test_rows_the_tokenizer_or_the_model_cannot_take_name_the_row(checkpoint, tmp_path):
    tok = load_tokenizer(checkpoint)
    unknown = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "max 1 2", "label": "2"},
                                                 {"prompt": "max one 2", "label": "2"}])
    with pytest.raises(PromptDataError, match=r"u\.jsonl:2: key 'prompt'"):
        load_run_prompts(RolloutConfig(prompt_data=str(unknown)), tok, vocab_size=len(VOCABULARY),
                         max_positions=256)
    long = write_jsonl(tmp_path / "l.jsonl", [{"prompt": " ".join(["1"] * 300), "label": "1"}])
    with pytest.raises(PromptDataError, match=r"l\.jsonl:1: key 'prompt' is 300 tokens; at most 254"):
        load_run_prompts(RolloutConfig(prompt_data=str(long)), tok, vocab_size=len(VOCABULARY),
                         max_positions=256)
    with pytest.raises(PromptDataError, match="no such prompt file"):
        read_rows(tmp_path / "missing.jsonl")


def test_parquet_rows_read_through_pyarrow(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": ["max 1 2", "min 3 4"], "label": ["2", "3"]}),
                   tmp_path / "p.parquet")
    rows = read_rows(tmp_path / "p.parquet")
    assert [(r.prompt, r.label, r.source) for r in rows] == [
        ("max 1 2", "2", f"{tmp_path / 'p.parquet'}:1"), ("min 3 4", "3", f"{tmp_path / 'p.parquet'}:2")]


def test_num_epoch_bounds_the_stream_and_each_epoch_is_reshuffled():
    prompts = digit_task_prompts(DigitTask(), 0, 5)
    src = PromptDataSource(prompts, seed=3, num_epoch=2)
    first, second = [p.index for p in src.next_batch(5)], [p.index for p in src.next_batch(5)]
    assert sorted(first) == sorted(second) == list(range(5))
    # the orders are numpy's permutations of (seed, epoch), computed here independently
    assert first == np.random.default_rng([3, 0]).permutation(5).tolist()
    assert second == np.random.default_rng([3, 1]).permutation(5).tolist()
    with pytest.raises(DataExhausted, match="--num-epoch 2"):
        src.next_batch(1)


def test_stop_ids_come_from_generation_config(checkpoint, tmp_path):
    assert load_tokenizer(checkpoint).eos_token_ids == (VOCABULARY.index("<eos>"),)
    import shutil
    d = Path(shutil.copytree(checkpoint, tmp_path / "c"))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))
    assert load_tokenizer(d).eos_token_ids == (5, 2)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match="eos_token_id must be an int"):
        load_tokenizer(d)


def test_chat_template_asked_for_but_missing_is_an_error(tmp_path):
    d = write_initial_checkpoint(build_config({}), tmp_path / "plain")
    with pytest.raises(TokenizerError, match="--apply-chat-template: .* has no chat template"):
        load_tokenizer(d, apply_chat_template=True)
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(tmp_path / "nothing")
