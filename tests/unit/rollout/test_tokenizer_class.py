"""The tokenizer a process without torch loads (the class ``AutoTokenizer`` resolves to, loaded
directly: ``replayrl.rollout.text.tokenizer_class``) is ``AutoTokenizer``'s tokenizer, over every
tokenizer the tests and examples use: the embedded word-level one (alone and in the initial
checkpoint), ``examples/own_data``'s, ``examples/environments``' Hermes one with its tool-calling
template, the chat-template tokenizers of the turn-separator tests, and the embedded tokenizer
beside each family type's ``config.json`` (where ``AutoTokenizer`` consults the model type).
The reference is transformers' ``AutoTokenizer`` itself (``tokenizer_class=None``). A tokenizer
without a chat template resolves to ``BackendTokenizer`` (the ``tokenizers`` library alone); one
that transformers changes beyond wrapping it keeps transformers' class."""
from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from replayrl.rollout.tasks import load_environment_class
from replayrl.rollout.text.backend_tokenizer import BACKEND_CLASS, BackendTokenizer
from replayrl.rollout.text.tokenizer import load_tokenizer
from replayrl.rollout.text.tokenizer_class import (
    AUTO,
    load_tokenizer_object,
    resolve_tokenizer,
    resolve_tokenizer_class,
)
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_embedded_tokenizer, write_initial_checkpoint
from tests.family_checkpoints import FAMILY_TYPES, tiny_hf_config
from tests.paths import REPO
from tests.unit.rollout.test_turn_separator import BLANK_LINE_TEMPLATE, QWEN_TEMPLATE, _make_tokenizer

ENVIRONMENTS = REPO / "examples" / "environments"
CALCULATOR = load_environment_class(f"{ENVIRONMENTS / 'python_calculator.py'}:PythonCalculatorEnv")
TORCH_FREE = "transformers.tokenization_utils_tokenizers:TokenizersBackend"


def _example(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """name -> (directory, tools the runs render prompts with or None without a template)."""
    root = tmp_path_factory.mktemp("tokenizers")
    out = {"embedded": (write_embedded_tokenizer(root / "embedded"), None),
           "embedded_checkpoint": (write_initial_checkpoint(build_config({}), root / "init"), None)}
    _example(REPO / "examples" / "own_data" / "make_data.py", "own_data_make").main(root / "own")
    out["own_data"] = (root / "own" / "checkpoint", ())
    env = root / "env"
    env.mkdir()
    _example(ENVIRONMENTS / "make_checkpoint.py", "env_make").write_tokenizer(env)
    out["environments"] = (env, CALCULATOR.tools)
    out["qwen_template"] = (_make_tokenizer(root, "qwen", QWEN_TEMPLATE, ["<|im_start|>", "<|im_end|>"],
                                            "<|im_end|>"), ())
    out["blank_line_template"] = (_make_tokenizer(root, "blank", BLANK_LINE_TEMPLATE,
                                                  ["<|turn|>", "<|end|>"], "<|end|>"), ())
    for model_type in FAMILY_TYPES:
        d = root / model_type
        tiny_hf_config(model_type).save_pretrained(str(d))
        for f in (root / "embedded").iterdir():
            shutil.copy(f, d / f.name)
        out[f"family_{model_type}"] = (d, None)
    return out


def _texts(tok) -> list[str]:
    """Texts of the tokenizer's own tokens (so a word-level vocabulary without an unknown token
    encodes them), with its special tokens inside."""
    vocab = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    plain = [t for t in vocab if t not in tok.all_special_tokens]
    specials = list(tok.all_special_tokens)
    return [" ".join(plain[:7]), " ".join(plain[::3][:12]), " ".join(plain[-5:]),
            f"{specials[0]} {' '.join(plain[2:5])} {specials[-1]}", plain[1]]


def _messages(text: str, tools: bool) -> list[dict]:
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": text}]
    if tools:
        messages += [{"role": "tool", "content": text}, {"role": "tool", "content": text[:3]}]
    return messages


CASES = ["embedded", "embedded_checkpoint", "own_data", "environments", "qwen_template",
         "blank_line_template", *(f"family_{t}" for t in FAMILY_TYPES)]


@pytest.mark.parametrize("name", CASES)
def test_the_resolved_class_loads_autotokenizers_tokenizer(dirs, name):
    directory, tools = dirs[name]
    resolved = resolve_tokenizer_class(directory)
    template = tools is not None
    # every one of them loads without torch; those without a chat template without transformers
    assert resolved == (TORCH_FREE if template else BACKEND_CLASS)
    ref = load_tokenizer(directory, apply_chat_template=template, tools=tools or ())
    got = load_tokenizer(directory, apply_chat_template=template, tools=tools or (), tokenizer_class=resolved)
    a, b = ref.tokenizer, got.tokenizer
    assert type(b) is (type(a) if template else BackendTokenizer)
    assert b.get_vocab() == a.get_vocab() and len(b) == len(a)
    assert (b.all_special_tokens, b.all_special_ids) == (a.all_special_tokens, a.all_special_ids)
    assert [b.bos_token_id, b.eos_token_id, b.pad_token_id] == [a.bos_token_id, a.eos_token_id, a.pad_token_id]
    assert got.eos_token_ids == ref.eos_token_ids
    for text in _texts(a):
        for special in (True, False):
            assert b(text, add_special_tokens=special)["input_ids"] == a(text, add_special_tokens=special)["input_ids"]
        ids = a(text)["input_ids"]
        for skip in (True, False):
            assert b.decode(ids, skip_special_tokens=skip) == a.decode(ids, skip_special_tokens=skip)
        if template:
            assert got.encode_prompt(text).tolist() == ref.encode_prompt(text).tolist()
            for add in (True, False):
                kwargs = {"tools": [dict(t) for t in tools]} if tools else {}
                messages = _messages(text, bool(tools))
                assert (b.apply_chat_template(messages, tokenize=False, add_generation_prompt=add, **kwargs)
                        == a.apply_chat_template(messages, tokenize=False, add_generation_prompt=add, **kwargs))
            turn = ref.encode_prompt(text)[-2:]
            assert (got.render_tool_text(text, turn).tolist() == ref.render_tool_text(text, turn).tolist())


def test_remote_code_keeps_autotokenizer(dirs, tmp_path):
    d = tmp_path / "remote"
    shutil.copytree(dirs["embedded"][0], d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_mine.MyTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert resolve_tokenizer_class(d) == AUTO


def test_auto_and_none_load_with_autotokenizer(dirs):
    from transformers import AutoTokenizer

    directory = dirs["environments"][0]
    ref = AutoTokenizer.from_pretrained(str(directory))
    for cls in (None, AUTO):
        tok = load_tokenizer_object(directory, cls)
        assert type(tok) is type(ref) and tok.get_vocab() == ref.get_vocab()


@pytest.mark.parametrize("name", ["embedded", "qwen_template"])
def test_the_resolution_hands_back_the_load_the_manager_makes(dirs, name):
    directory, _ = dirs[name]
    resolved, loaded = resolve_tokenizer(directory)
    fresh = load_tokenizer_object(directory, resolved)  # the rollout manager's load
    assert type(loaded) is type(fresh) and loaded.get_vocab() == fresh.get_vocab()
    for text in _texts(fresh):
        assert loaded(text)["input_ids"] == fresh(text)["input_ids"]
    # the prompt check takes it as it is, without reading the directory again
    assert load_tokenizer(directory, tokenizer_class=resolved, tokenizer_object=loaded).tokenizer is loaded


def test_remote_code_hands_back_nothing_loaded(dirs, tmp_path):
    d = tmp_path / "remote"
    shutil.copytree(dirs["embedded"][0], d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_mine.MyTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert resolve_tokenizer(d) == (AUTO, None)


def _edited(src, dst, **config):
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dst


@pytest.mark.parametrize("config", [{"clean_up_tokenization_spaces": True},  # decode differs
                                    {"extra_special_tokens": ["<tool>"]},  # a token transformers adds
                                    {"split_special_tokens": True}])
def test_a_tokenizer_transformers_changes_keeps_its_class(dirs, tmp_path, config):
    d = _edited(dirs["embedded"][0], tmp_path / "edited", **config)
    resolved, loaded = resolve_tokenizer(d)
    assert resolved == TORCH_FREE and type(loaded).__name__ == "TokenizersBackend"


def test_a_post_processor_of_the_file_is_kept(dirs, tmp_path):
    from transformers import AutoTokenizer

    d = _edited(dirs["embedded"][0], tmp_path / "bos")
    spec = json.loads((d / "tokenizer.json").read_text())
    bos = spec["added_tokens"][1]
    assert bos["content"] == "<bos>"
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<bos>": {"id": "<bos>", "ids": [bos["id"]],
                                                           "tokens": ["<bos>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    resolved, light = resolve_tokenizer(d)
    ref = AutoTokenizer.from_pretrained(str(d))
    assert resolved == BACKEND_CLASS
    for special in (True, False):
        assert (light("3 4", add_special_tokens=special)["input_ids"]
                == ref("3 4", add_special_tokens=special)["input_ids"])
    assert light("3 4")["input_ids"][0] == bos["id"]


def test_the_backend_tokenizer_answers_the_rest_with_transformers(dirs):
    from transformers import AutoTokenizer

    directory = dirs["embedded_checkpoint"][0]
    light = load_tokenizer_object(directory, BACKEND_CLASS)
    ref = AutoTokenizer.from_pretrained(str(directory))
    ids = ref("1 2 3")["input_ids"]
    assert light("1 2 3")["input_ids"] == ids
    assert light._transformers is None  # its own calls load no transformers
    # not among its own methods: served by transformers' class, loaded on first use
    assert light.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert light.batch_decode([ids, ids[:1]]) == ref.batch_decode([ids, ids[:1]])
    assert light(["1", "2 3"])["input_ids"] == ref(["1", "2 3"])["input_ids"]
    assert light("1 2", return_attention_mask=True)["attention_mask"] == [1, 1]


def test_a_change_through_transformers_is_seen_by_every_later_call(dirs):
    from transformers import AutoTokenizer

    directory = dirs["embedded_checkpoint"][0]
    light = load_tokenizer_object(directory, BACKEND_CLASS)
    ref = AutoTokenizer.from_pretrained(str(directory))
    for tok in (light, ref):
        tok.add_tokens(["<newtok>"])
        tok.pad_token = tok.eos_token
    assert len(light) == len(ref) == 45
    assert light("1 <newtok>")["input_ids"] == ref("1 <newtok>")["input_ids"] == [4, 44]
    assert light.pad_token_id == ref.pad_token_id == ref.eos_token_id
    assert light.get_vocab() == ref.get_vocab()
    assert light.decode([4, 44]) == ref.decode([4, 44])
