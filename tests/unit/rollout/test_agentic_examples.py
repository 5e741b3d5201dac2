"""The generators of examples/agentic/: demonstrations and RL prompts disjoint, every answer
the tool's (checked against Python's own product and the corpus line that states the fact),
and every demonstration a conversation ``replayrl sft`` trains on with the example
checkpoint's chat template (examples/environments/make_checkpoint.py)."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest

from replayrl.rollout.text.conversation import render_conversation
from replayrl.rollout.text.tokenizer import load_tokenizer
from tests.paths import REPO

AGENTIC = REPO / "examples" / "agentic"


def _module(path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    directory = tmp_path_factory.mktemp("env_tok")
    _module(REPO / "examples" / "environments" / "make_checkpoint.py").write_tokenizer(directory)
    return load_tokenizer(directory, apply_chat_template=True)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _place(question: str) -> str:
    """The invented place a question asks about."""
    return re.search(r"(?:capital|founding year) of (\w+)\?", question).group(1)


def _trains(tok, rows, turns=2):
    for row in rows:
        c = render_conversation(tok, row["messages"], max_length=1024, tools=row.get("tools"))
        # an assistant run per assistant turn (the call, the answer), each closed by the end-of-turn id
        ends = [i for i in range(len(c.loss_mask)) if c.loss_mask[i]
                and (i + 1 == len(c.loss_mask) or not c.loss_mask[i + 1])]
        assert [int(c.response_ids[i]) for i in ends] == [tok.eos_token_id] * turns


def test_arithmetic_demonstrations_copy_the_product_and_miss_every_rl_question(tmp_path, tok, monkeypatch):
    monkeypatch.syspath_prepend(str(AGENTIC))
    _module(AGENTIC / "make_arithmetic.py").main([str(tmp_path), "--sft", "12", "--rl", "6"])
    sft, rl = _rows(tmp_path / "sft.jsonl"), _rows(tmp_path / "rl.jsonl")
    assert (len(sft), len(rl)) == (12, 6)
    questions = {r["messages"][0]["content"] for r in sft}
    assert not questions & {r["prompt"] for r in rl}
    for row in sft:
        a, b = (int(x) for x in row["messages"][0]["content"].rsplit(": ", 1)[1].split(" * "))
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert row["messages"][2]["content"] == row["messages"][3]["content"] == str(a * b)
        assert f'"expression": "{a} * {b}"' in row["messages"][1]["content"]
    for row in rl:
        a, b = (int(x) for x in row["prompt"].rsplit(": ", 1)[1].split(" * "))
        assert row["label"] == str(a * b)
    _trains(tok, sft)


@pytest.mark.parametrize("names", ["letters", "syllables"])
def test_retrieval_demonstrations_answer_from_the_corpus_and_hold_out_the_rl_places(tmp_path, tok, monkeypatch, names):
    monkeypatch.syspath_prepend(str(AGENTIC))
    _module(AGENTIC / "make_retrieval.py").main([str(tmp_path), "--places", "8", "--sft", "10",
                                                 "--names", names])
    corpus = (tmp_path / "corpus.txt").read_text().splitlines()
    sft, rl = _rows(tmp_path / "sft.jsonl"), _rows(tmp_path / "rl.jsonl")
    assert len(corpus) == 16 and len(sft) == 10 and len(rl) == 2 * 2  # a quarter of 8 places
    held = {_place(r["prompt"]) for r in rl}
    if names == "letters":  # four distinct capitals, each a token of its own
        assert all(len(set(p)) == 4 and p.isupper() for p in held)
    for row in sft:
        question, answer = row["messages"][0]["content"], row["messages"][3]["content"]
        assert _place(question) not in held
        fact = (f"The capital of {_place(question)} is {answer}." if "capital" in question
                else f"The founding year of {_place(question)} is {answer}.")
        assert fact in corpus and fact in row["messages"][2]["content"]  # the tool found it
        assert not set(re.findall(r"\w+", row["messages"][2]["content"])) & held  # nor leaked
        query = json.loads(re.search(r"<tool_call>(.*)</tool_call>", row["messages"][1]["content"])[1])
        assert query["arguments"]["query"] in question  # the question's own words
    for row in rl:
        assert row["metadata"]["corpus"] == str((tmp_path / "corpus.txt").resolve())
    _trains(tok, sft)


@pytest.mark.parametrize("script", ["make_arithmetic.py", "make_retrieval.py"])
def test_the_no_tool_baseline_answers_at_once_on_the_same_rl_prompts(tmp_path, tok, monkeypatch, script):
    monkeypatch.syspath_prepend(str(AGENTIC))
    main = _module(AGENTIC / script).main
    main([str(tmp_path / "tool"), "--sft", "10"])
    main([str(tmp_path / "none"), "--sft", "10", "--no-tool"])
    tool, none = _rows(tmp_path / "tool" / "sft.jsonl"), _rows(tmp_path / "none" / "sft.jsonl")
    assert len(none) == 10
    for row in none:  # the question, then the tool's answer to it, no call, no schema
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"] and "tools" not in row
        assert "<tool_call>" not in row["messages"][1]["content"]
    assert ([(r["messages"][0]["content"], r["messages"][1]["content"]) for r in none]
            == [(r["messages"][0]["content"], r["messages"][3]["content"]) for r in tool])
    _trains(tok, none, turns=1)
    rl_tool = (tmp_path / "tool" / "rl.jsonl").read_text().replace(str(tmp_path / "tool"), "")
    assert rl_tool == (tmp_path / "none" / "rl.jsonl").read_text().replace(str(tmp_path / "none"), "")


async def test_the_corpus_environment_searches_the_corpus_its_prompt_names(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import numpy as np

    from replayrl.rollout.tasks.environment import ToolCall, Turn

    monkeypatch.syspath_prepend(str(AGENTIC))
    _module(AGENTIC / "make_retrieval.py").main([str(tmp_path), "--places", "8", "--sft", "10"])
    row = _rows(tmp_path / "rl.jsonl")[0]
    place = _place(row["prompt"])
    env = _module(AGENTIC / "corpus_retrieval.py").CorpusRetrievalEnv()
    await env.reset(SimpleNamespace(metadata=row["metadata"]))
    call = ToolCall("search", {"query": row["prompt"]})
    step = await env.step(Turn(0, np.zeros(0, np.int32), "", (call,), "stop"))
    facts = [line for line in (tmp_path / "corpus.txt").read_text().splitlines() if place in line]
    assert facts and any(fact in step.observation for fact in facts)  # this prompt's corpus, not corpus.txt
