"""The shipped Python calculator environment (examples/environments/python_calculator.py):
its whitelist, its limited subprocess, and token fidelity across turns with a real tokenizer
and chat template. A system test: every evaluation starts a ``python`` subprocess.
"""
from __future__ import annotations

import pytest

from replayrl.rollout.episodes.turn_loop import assemble
from replayrl.rollout.text.tokenizer import load_tokenizer
from tests.unit.rollout.test_env_interface import (
    CALC,
    TOOLS_TEMPLATE,
    _call,
    _episodes,
    _ids,
    _make_tokenizer,
    _prompt,
    _whole,
)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return _make_tokenizer(tmp_path_factory.mktemp("tools"), "qwen_tools", TOOLS_TEMPLATE,
                           ["<|im_start|>", "<|im_end|>"], "<|im_end|>")


@pytest.mark.parametrize("expression, refused", [
    ("open('/etc/passwd').read()", "Call is not allowed"),
    ("__import__('os').system('true')", "Call is not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("'a' * 3", "is not a number"),
    ("2 ** 100000", "exponent 100000 is over"),
])
async def test_the_calculator_refuses_everything_but_arithmetic(expression, refused):
    import sys
    evaluate = sys.modules[CALC.__module__].evaluate
    assert refused in await evaluate(expression)


async def test_the_calculator_computes_in_a_limited_subprocess():
    import sys
    evaluate = sys.modules[CALC.__module__].evaluate
    assert await evaluate("(128 - 17) * 3") == str((128 - 17) * 3)
    assert await evaluate("7 / 2") == repr(7 / 2)
    # a huge power the whitelist lets through (its exponent is not a literal) hits the limits:
    # the child's CPU / memory rlimit, or on a loaded machine the parent's wall-clock limit first
    assert await evaluate("9 ** 9 ** 9") in ("error: time or memory limit", "error: time limit")


async def test_calculator_trained_ids_are_the_ids_every_engine_call_saw(tokdir):
    tok = load_tokenizer(tokdir, apply_chat_template=True, tools=CALC.tools)
    call, answer = _call("calculate", expression="37 * 41 + 5"), "1522"
    (episode,), seen = await _episodes(tok, CALC, [_prompt(tok, "question?")], [[call, answer]])
    assert episode.finish_reason == "stop" and episode.num_tool_calls == 1
    messages = [{"role": "user", "content": "question?"},
                {"role": "assistant", "content": call},
                {"role": "tool", "content": str(37 * 41 + 5)},
                {"role": "assistant", "content": answer}]
    assert seen[1][0] == _whole(tok, messages[:3], CALC.tools, add_generation_prompt=True)
    merged, _ = assemble(episode, sample_id=0, require=())
    trained = list(episode.prompt_ids) + merged.sample_fields()["response_ids"].tolist()
    whole = _whole(tok, messages, CALC.tools)
    assert trained == whole[:len(trained)] and whole[len(trained):] == _ids(tok, "\n")
