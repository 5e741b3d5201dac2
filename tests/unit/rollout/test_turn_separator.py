"""The text a chat template puts after an assistant turn's end-of-turn token (Qwen's '\\n'
after ``<|im_end|>``) is part of the context of the next turn (docs/design/prompt-data.md#prompt-data).

An engine turn ends with the sampled end-of-turn token; the template renders a separator after
it before the tool message. The assembled ``prompt_ids + response_ids`` of a two-turn episode
must be, token for token, the tokenisation of ``apply_chat_template`` of the whole
conversation, with loss mask 0 exactly on the separator + rendered tool turn. The expected ids
are computed by transformers from the whole conversation's text, and the observation rows by
hand from the template's text, never from the code under test.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from replayrl.rollout.engines.base import Generation
from replayrl.rollout.episodes.env_sessions import EnvSessions
from replayrl.rollout.episodes.turn_loop import assemble, run_episodes
from replayrl.rollout.errors import ChatTemplateError
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.text.tokenizer import load_tokenizer
from tests.paths import REPO


def _example_checkpoint_module():
    """examples/environments/make_checkpoint.py (a script, not a package), loaded by path."""
    spec = importlib.util.spec_from_file_location(
        "example_make_checkpoint", REPO / "examples" / "environments" / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_EXAMPLE = _example_checkpoint_module()
# Qwen's layout, the example checkpoint's template: every message closes with "<|im_end|>\n";
# tool results are a user turn (its tools system turn renders nothing here: no tools are given).
QWEN_TEMPLATE = _EXAMPLE.TEMPLATE
# Another layout: a blank line ("\n\n", two tokens here) after the end-of-turn token.
BLANK_LINE_TEMPLATE = (
    "{%- for message in messages %}{{- '<|turn|>' + message.role + ': ' + message.content"
    " + '<|end|>\\n\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn|>assistant: ' }}{%- endif %}")
# Qwen3's quirk: the last assistant message gets an empty think block, which disappears once a
# tool message follows it -- adding a tool message rewrites an earlier turn.
REWRITING_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and loop.last %}{{- '<think></think>' }}{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# The end-of-turn token is not right after the content: a newline comes first, which the engine
# (stopping on "<|im_end|>") never generates.
NEWLINE_FIRST_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content"
    " + '\\n<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

CHARS = _EXAMPLE.CHARS  # one token per printable ASCII character


def _make_tokenizer(root: Path, name: str, template: str, special: list[str], eos: str) -> Path:
    """A character-level tokenizer (one token per character, the specials whole) with
    ``template``, saved to ``root / name``; nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos,
                                   additional_special_tokens=[s for s in special if s != eos])
    fast.chat_template = template
    d = root / name
    fast.save_pretrained(str(d))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": fast.convert_tokens_to_ids(eos)}))
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    return {
        "qwen": _make_tokenizer(root, "qwen", QWEN_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
        "blank_line": _make_tokenizer(root, "blank", BLANK_LINE_TEMPLATE, ["<|turn|>", "<|end|>"], "<|end|>"),
        "newline_first": _make_tokenizer(root, "newline_first", NEWLINE_FIRST_TEMPLATE,
                                         ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
        "rewriting": _make_tokenizer(root, "rewriting", REWRITING_TEMPLATE,
                                     ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    }


def _ids(tok, text: str) -> list[int]:
    """``text`` tokenised by transformers alone (no special tokens added)."""
    return tok.tokenizer(text, add_special_tokens=False)["input_ids"]


def _gen(ids, finish):
    return Generation(response_ids=np.array(ids, np.int32),
                      rollout_logprobs=np.full(len(ids), -0.5, np.float32),
                      finish_reason=finish, sample_support=None, routed_experts=None,
                      indexer_topk=None)


class AnswerOnce:
    """The first turn is a tool call answered with the ids of ``text``; later turns are final."""

    def __init__(self, ids):
        self.ids = np.asarray(ids, np.int32)
        self.calls = 0

    def observe(self, prompt_ids, turn_ids):
        self.calls += 1
        return self.ids if self.calls == 1 else None


async def _episode(tok, turn_ids: list[list[int]], observation: str, finishes=("stop", "stop")):
    """One two-turn episode of prompt "what is 6*7?" through the turn loop; returns the
    episode, the context the engine saw for turn 1, and the merged trajectory."""
    prompt = tok.encode_prompt("what is 6*7?")
    seen: list[list[int]] = []
    turns = iter([_gen(ids, f) for ids, f in zip(turn_ids, finishes)])

    async def generate_turn(contexts, seed):
        seen.append(list(contexts[0]))
        return [next(turns)], 0

    (episode,) = await run_episodes(generate_turn, [prompt], max_turns=2, max_new_tokens=64,
                                    max_positions=4096, seed=0,
                                    env=EnvSessions.of_task(AnswerOnce(_ids(tok, observation)),
                                                            [Prompt(0, prompt, -1)], tokenizer=tok))
    merged, _ = assemble(episode, sample_id=7, require=())
    return episode, seen, merged.sample_fields()


def _whole(tok, messages, **kwargs) -> list[int]:
    """transformers' rendering of the whole conversation, tokenised."""
    return _ids(tok, tok.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))


CASES = {
    # name: (end-of-turn token, the separator the template writes after it, the rendered tool turn
    #        and the next generation prompt, written out by hand from the template)
    "qwen": ("<|im_end|>", "\n",
             "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    "blank_line": ("<|end|>", "\n\n", "<|turn|>tool: 42<|end|>\n\n<|turn|>assistant: "),
}


@pytest.mark.parametrize("name", sorted(CASES))
async def test_two_turn_episode_is_the_whole_conversation_rendered(dirs, name):
    eot, separator, tool_turn = CASES[name]
    tok = load_tokenizer(dirs[name], apply_chat_template=True)
    eot_id = tok.tokenizer.convert_tokens_to_ids(eot)
    call, answer = "calc 6*7", "it is 42"
    turn0 = _ids(tok, call) + [eot_id]
    turn1 = _ids(tok, answer) + [eot_id]
    episode, seen, f = await _episode(tok, [turn0, turn1], "42")

    messages = [{"role": "user", "content": "what is 6*7?"}, {"role": "assistant", "content": call},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": answer}]
    # the engine's context for turn 1 is the conversation so far with the generation prompt
    assert seen[1] == _whole(tok, messages[:3], add_generation_prompt=True)
    # the trajectory is the whole conversation, up to the separator after the last turn's
    # end-of-turn token (the engine stopped on it)
    whole = _whole(tok, messages)
    assembled = list(episode.prompt_ids) + f["response_ids"].tolist()
    assert whole[len(assembled):] == _ids(tok, separator)
    assert assembled == whole[:len(assembled)]
    # the generated end-of-turn token kept and trained; separator + tool turn masked, no rows
    observed = len(_ids(tok, separator + tool_turn))
    assert f["loss_mask"].tolist() == [1] * len(turn0) + [0] * observed + [1] * len(turn1)
    assert f["response_ids"][len(turn0) - 1] == eot_id
    assert (f["rollout_logprobs"][len(turn0):len(turn0) + observed] == 0.0).all()


async def test_a_turn_cut_before_its_end_of_turn_token_gets_the_whole_closing(dirs):
    """A tool call cut at the length limit has no end-of-turn token: the template's closing
    ("<|im_end|>\\n") is appended as observation tokens, still the whole conversation."""
    tok = load_tokenizer(dirs["qwen"], apply_chat_template=True)
    eot_id = tok.tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn0, turn1 = _ids(tok, "calc 6*"), _ids(tok, "42") + [eot_id]
    episode, seen, f = await _episode(tok, [turn0, turn1], "42", finishes=("length", "stop"))
    messages = [{"role": "user", "content": "what is 6*7?"}, {"role": "assistant", "content": "calc 6*"},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]
    assert seen[1] == _whole(tok, messages[:3], add_generation_prompt=True)
    closing = "<|im_end|>\n" + CASES["qwen"][2]
    assert f["loss_mask"].tolist() == [1] * len(turn0) + [0] * len(_ids(tok, closing)) + [1] * len(turn1)
    assert list(episode.prompt_ids) + f["response_ids"].tolist() == _whole(tok, messages)[:-1]


async def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_sample(dirs):
    tok = load_tokenizer(dirs["rewriting"], apply_chat_template=True)
    eot_id = tok.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ChatTemplateError, match="rewrites earlier turns") as info:
        await _episode(tok, [_ids(tok, "calc") + [eot_id], _ids(tok, "42") + [eot_id]], "42")
    assert info.value.sample_id == 0 and info.value.field == "observations"


async def test_a_stop_token_the_template_does_not_put_right_after_the_content_is_refused(dirs):
    tok = load_tokenizer(dirs["newline_first"], apply_chat_template=True)
    eot_id = tok.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ChatTemplateError, match="not right after the content") as info:
        await _episode(tok, [_ids(tok, "calc") + [eot_id], _ids(tok, "42") + [eot_id]], "42")
    assert info.value.sample_id == 0 and info.value.field == "response_ids"
