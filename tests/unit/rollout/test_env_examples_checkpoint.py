"""The example tool-calling checkpoint's tokenizer and chat template
(examples/environments/make_checkpoint.py) and the format-credit reward
(examples/environments/format_credit.py) the example training tables use.

Expected ids are transformers' rendering of the whole conversation; expected credits are
worked out by hand from the module docstring's definition.
"""
from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from replayrl.rollout.episodes.turn_loop import assemble
from replayrl.rollout.tasks import load_environment_class
from replayrl.rollout.tasks.environment import Turn, hermes_tool_calls
from replayrl.rollout.text.tokenizer import load_tokenizer
from tests.paths import REPO
from tests.unit.rollout.test_env_interface import _episodes, _prompt, _whole

EXAMPLES = REPO / "examples" / "environments"
RETRIEVAL = load_environment_class(f"{EXAMPLES / 'format_credit.py'}:RetrievalWithFormatCredit")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def make():
    return _module("make_checkpoint")


@pytest.fixture(scope="module")
def tokdir(make, tmp_path_factory):
    d = tmp_path_factory.mktemp("env_tok")
    make.write_tokenizer(d)
    return d


def test_a_hermes_call_is_a_few_tokens_and_reads_back_as_the_call(make, tokdir):
    tok = load_tokenizer(tokdir, apply_chat_template=True)
    text = make.CALL_OPEN["calculate"] + "7*3" + make.CALL_CLOSE
    assert text == '<tool_call>{"name": "calculate", "arguments": {"expression": "7*3"}}</tool_call>'
    ids = tok.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 2 + 3  # the wrapper with its keys, three characters, the closing
    assert tok.tokenizer.decode(ids, skip_special_tokens=False) == text
    (call,) = hermes_tool_calls(text)
    assert (call.name, dict(call.arguments), call.error) == ("calculate", {"expression": "7*3"}, "")
    assert tok.eos_token_ids == (tok.tokenizer.convert_tokens_to_ids("<|im_end|>"),)


async def test_with_the_example_template_trained_ids_are_the_ids_every_engine_call_saw(make, tokdir):
    tok = load_tokenizer(tokdir, apply_chat_template=True, tools=RETRIEVAL.tools)
    call, answer = make.CALL_OPEN["search"] + "capital of Australia" + make.CALL_CLOSE, "Canberra"
    (episode,), seen = await _episodes(tok, RETRIEVAL, [_prompt(tok, "question?")], [[call, answer]])
    assert episode.finish_reason == "stop" and episode.num_tool_calls == 1
    assert episode.env_reward == 0.5  # a well-formed search call in turn 0
    tool_text = "\n".join(sys.modules[load_environment_class("retrieval").__module__]
                          .index().search("capital of Australia"))
    messages = [{"role": "user", "content": "question?"}, {"role": "assistant", "content": call},
                {"role": "tool", "content": tool_text}, {"role": "assistant", "content": answer}]
    assert seen[1][0] == _whole(tok, messages[:3], RETRIEVAL.tools, add_generation_prompt=True)
    merged, _ = assemble(episode, sample_id=0, require=())
    trained = list(episode.prompt_ids) + merged.sample_fields()["response_ids"].tolist()
    whole = _whole(tok, messages, RETRIEVAL.tools)
    assert trained == whole[:-1] and tok.tokenizer.decode(whole[-1:]) == "\n"


@pytest.mark.parametrize("index, text, credit", [
    (0, "Canberra", 0.0),
    (0, "<tool_call>{broken", 0.25),  # the wrapper, no readable call
    (0, '<tool_call>{"name": "lookup", "arguments": {"query": "x"}}</tool_call>', 0.25),
    (0, '<tool_call>{"name": "search", "arguments": {"query": 3}}</tool_call>', 0.25),
    (0, '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>', 0.5),
    (1, '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>', 0.0),
])
def test_format_credit_by_hand(index, text, credit):
    format_credit = sys.modules[RETRIEVAL.__module__].format_credit
    turn = Turn(index, np.zeros(1, np.int32), text, hermes_tool_calls(text), "stop")
    assert format_credit(turn, "search", "query") == credit


def test_the_checkpoint_size_flags_give_the_model_they_name(make, tmp_path):
    import json

    from safetensors import safe_open

    make.main(tmp_path / "ck", hidden_size=32, layers=3, seed=1)
    c = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert (c["hidden_size"], c["num_hidden_layers"], c["head_dim"], c["num_attention_heads"]) \
        == (32, 3, 8, 4)
    assert (c["intermediate_size"], c["moe_intermediate_size"]) == (64, 32)
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_slice("model.embed_tokens.weight").get_shape()) == (c["vocab_size"], 32)
    # the first layer dense, the others routed (a router per MoE layer)
    assert [f"model.layers.{i}.mlp.gate.weight" in names for i in range(3)] == [False, True, True]
    assert "model.layers.0.mlp.up_proj.weight" in names and "model.layers.3.mlp.gate.weight" not in names
    for bad, flag in (({"hidden_size": 40}, "--hidden-size"), ({"layers": 1}, "--layers")):
        with pytest.raises(ValueError, match=flag):
            make.main(tmp_path / "bad", **bad)
