"""A chat conversation cut into prompt, assistant turns and observations by the chat template:
the loss mask is 1 on exactly the assistant's tokens, their end-of-turn token included
(rollout/text/conversation.py). The tokenizer is character level (tests/chat_checkpoint.py),
so every expected count below is the length of a text written out by hand."""
from __future__ import annotations

import numpy as np
import pytest

from replayrl.rollout.text.conversation import ConversationError, render_conversation
from replayrl.rollout.text.tokenizer import load_tokenizer
from tests.chat_checkpoint import write_chat_tokenizer

CALL = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "1+2"}}}
CONVERSATION = [{"role": "system", "content": "calc"}, {"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat")
    write_chat_tokenizer(directory)
    return load_tokenizer(directory, apply_chat_template=True)


def _ids(tok, text: str) -> list[int]:
    """Character-level ids, the two special markers as their one id each (by hand)."""
    out, i = [], 0
    while i < len(text):
        for special in ("<|im_start|>", "<|im_end|>"):
            if text.startswith(special, i):
                out.append(tok.tokenizer.convert_tokens_to_ids(special))
                i += len(special)
                break
        else:
            out.append(tok.tokenizer.convert_tokens_to_ids(text[i]))
            i += 1
    return out


def test_the_mask_is_one_on_exactly_the_assistant_tokens_and_their_end_of_turn(tok):
    c = render_conversation(tok, CONVERSATION, max_length=1000)
    prompt = "<|im_start|>system\ncalc<|im_end|>\n<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n"
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1+2"}}\n</tool_call><|im_end|>'
    tool = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    answer = "3<|im_end|>"
    assert c.prompt_ids.tolist() == _ids(tok, prompt)
    assert c.response_ids.tolist() == _ids(tok, call) + _ids(tok, tool) + _ids(tok, answer)
    expected = [1] * len(_ids(tok, call)) + [0] * len(_ids(tok, tool)) + [1] * len(_ids(tok, answer))
    assert c.loss_mask.tolist() == expected
    assert c.loss_mask.dtype == np.uint8 and c.length == len(_ids(tok, prompt + call + tool + answer))
    # the end-of-turn token closes each assistant run: the last 1 before a 0, and the last row
    eos = tok.tokenizer.convert_tokens_to_ids("<|im_end|>")
    run_ends = [i for i in range(len(expected)) if expected[i] and (i + 1 == len(expected) or not expected[i + 1])]
    assert [int(c.response_ids[i]) for i in run_ends] == [eos, eos]


def test_the_pieces_join_into_the_template_rendering_of_the_conversation(tok):
    c = render_conversation(tok, CONVERSATION + [{"role": "user", "content": "thanks"}], max_length=1000)
    whole = tok.tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # the trailing user message carries no loss and is left out; so is the template's last "\n"
    assert tok.tokenizer.decode(np.concatenate([c.prompt_ids, c.response_ids])) == whole[:-1]


@pytest.mark.parametrize("messages, reason, says", [
    ([{"role": "user", "content": "hi"}], "no_assistant", "no assistant message"),
    ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}], "unknown_role", "role 'robot'"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], "malformed", "message 0"),
    ("hi", "malformed", "non-empty list"),
])
def test_a_bad_conversation_names_the_row_and_the_reason(tok, messages, reason, says):
    with pytest.raises(ConversationError, match=f"data.jsonl:7: .*{says}") as info:
        render_conversation(tok, messages, max_length=1000, where="data.jsonl:7")
    assert info.value.reason == reason


def test_a_conversation_longer_than_the_limit_is_refused(tok):
    n = render_conversation(tok, CONVERSATION, max_length=1000).length
    assert render_conversation(tok, CONVERSATION, max_length=n).length == n
    with pytest.raises(ConversationError, match=f"{n} tokens, longer than the limit of {n - 1}") as info:
        render_conversation(tok, CONVERSATION, max_length=n - 1)
    assert info.value.reason == "too_long"


def test_the_pieces_are_the_ids_and_masks_of_the_rollout_that_wrote_this_conversation(tok):
    # what the turn loop builds when the policy generates the two assistant turns: the prompt
    # as encode_prompt renders it, each turn's generated ids (mask 1), the tool answer as
    # render_tool_text appends it after the turn (mask 0)
    c = render_conversation(tok, CONVERSATION, max_length=1000)
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1+2"}}\n</tool_call><|im_end|>'
    turn0, turn1 = _ids(tok, call), _ids(tok, "3<|im_end|>")
    observation = tok.render_tool_text("3", np.array(turn0)).tolist()
    assert c.prompt_ids.tolist() == tok.encode_prompt(CONVERSATION[:2]).tolist()
    assert c.response_ids.tolist() == turn0 + observation + turn1
    assert c.loss_mask.tolist() == [1] * len(turn0) + [0] * len(observation) + [1] * len(turn1)
