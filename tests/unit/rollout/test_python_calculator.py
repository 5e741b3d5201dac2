"""The shipped calculator environment (examples/environments/python_calculator.py) against
hostile input: its evaluator computes only whitelisted arithmetic, bounded before it computes,
never runs the text, never raises; the tool-call parser and the environment answer any turn
text; and token fidelity across turns with a real tokenizer and chat template.

Values are checked against Python's own arithmetic on the same literal text (``eval`` of
trusted, test-written expressions), never against the evaluator under test.
"""
from __future__ import annotations

import json
import random
import sys
import time

import numpy as np
import pytest

from replayrl.rollout.episodes.turn_loop import assemble
from replayrl.rollout.tasks.environment import Turn, hermes_tool_calls
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

calc = sys.modules[CALC.__module__]
evaluate = calc.evaluate


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return _make_tokenizer(tmp_path_factory.mktemp("tools"), "qwen_tools", TOOLS_TEMPLATE,
                           ["<|im_start|>", "<|im_end|>"], "<|im_end|>")


def _short(value) -> str:
    """A test id: the value's repr, cut (some are a megabyte long)."""
    return repr(value)[:40]


def _random_expression(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.3:
        return rng.choice([str(rng.randint(0, 999)), f"{rng.uniform(0, 100):.3f}"])
    if rng.random() < 0.15:
        return rng.choice(["-", "+"]) + _random_expression(rng, depth - 1)
    op = rng.choice(["+", "-", "*", "/", "//", "%", "**"])
    right = str(rng.randint(0, 4)) if op == "**" else _random_expression(rng, depth - 1)
    return f"({_random_expression(rng, depth - 1)} {op} {right})"


def test_values_are_python_arithmetic_on_the_same_text():
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        expression = _random_expression(rng, 4)
        try:
            expected = eval(expression, {"__builtins__": {}})  # noqa: S307 -- test-written text
        except ZeroDivisionError:
            assert evaluate(expression) == "error: division by zero"
            continue
        if isinstance(expected, complex):
            assert evaluate(expression).startswith("error: ")
            continue
        assert evaluate(expression) == repr(expected), expression
        checked += 1
    assert checked > 300
    assert evaluate("37 * 41 + 5") == "1522" and evaluate("7 / 2") == "3.5"
    assert evaluate("-7 % 3") == "2" and evaluate("5 // -2") == "-3" and evaluate("2 ** -2") == "0.25"
    assert evaluate("2 ** 9999") == str(2 ** 9999)  # the largest power of two within the bound


@pytest.mark.parametrize("expression, refused", [
    ("open('pwned', 'w').write('x')", "Call is not allowed"),
    ("__import__('os').system('touch pwned')", "Call is not allowed"),
    ("exec(\"open('pwned', 'w')\")", "Call is not allowed"),
    ("eval('1')", "Call is not allowed"),
    ("__import__('os').fork()", "Call is not allowed"),
    ("[__import__('os').fork() for _ in range(9)]", "ListComp is not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("().__class__.__bases__[0].__subclasses__()", "Call is not allowed"),
    ("[].__class__.__mro__", "Attribute is not allowed"),
    ("__builtins__", "Name is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("(1)[0]", "Subscript is not allowed"),
    ("[x for x in ()]", "ListComp is not allowed"),
    ("lambda: 1", "Lambda is not allowed"),
    ("(y := 1)", "NamedExpr is not allowed"),
    ("1 if 1 else 2", "IfExp is not allowed"),
    ("1 < 2", "Compare is not allowed"),
    ("1 << 100000", "LShift is not allowed"),
    ("'a' * 10 ** 9", "constant 'a' is not a number"),
    ("b'x'", "constant b'x' is not a number"),
    ("True + 1", "constant True is not a number"),
    ("1j", "constant 1j is not a number"),
    ("import os", "not an expression"),
    ("1; import os", "not an expression"),
], ids=_short)
def test_escapes_are_refused_by_name_and_touch_nothing(expression, refused, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").write_text("kept")
    before = sorted(p.name for p in tmp_path.iterdir())
    answer = evaluate(expression)
    assert answer.startswith("error: ") and refused in answer, answer
    assert sorted(p.name for p in tmp_path.iterdir()) == before == ["kept"]


@pytest.mark.parametrize("expression, refused", [
    ("9 ** 9 ** 9", "the result would have over 10000 bits"),
    ("2 ** 10000", "the result would have over 10000 bits"),
    ("3 ** 9999", "the result has over 10000 bits"),
    ("(10 ** 3000) ** 3", "the result would have over 10000 bits"),
    ("10 ** 3000 * 10 ** 3000", "the result would have over 10000 bits"),
    ("(10 ** 3000) / 3", "OverflowError"),
    ("10.0 ** 400", "OverflowError"),
    ("1e308 * 10", "the result is not finite"),
    ("1e999", "the result is not finite"),
    ("(-8) ** 0.5", "the result is not a real number"),
    ("1 / 0", "division by zero"),
    ("1 % 0.0", "division by zero"),
    ("-" * 499 + "1", "nests deeper than 64 levels"),
    ("(" * 300 + "1" + ")" * 300, "expression is 601 characters, over the 500 allowed"),
    ("(" * 210 + "1" + ")" * 210, "not an expression"),  # the parser's own nesting limit
    ("1" * 501, "over the 500 allowed"),
    ("1 + " * 10 ** 6 + "1", "over the 500 allowed"),
    ("\ud800 + 1", "not an expression"),  # a lone surrogate: not valid Unicode
    ("1 + \x00", "not an expression"),
], ids=_short)
def test_exhausting_expressions_are_refused_before_they_cost(expression, refused):
    started = time.process_time()
    answer = evaluate(expression)
    assert answer.startswith("error: ") and refused in answer, answer
    # a hang guard, not a speed claim: each is refused in microseconds (9 ** 9 ** 9 computed
    # would take minutes and gigabytes)
    assert time.process_time() - started < 0.5


@pytest.mark.parametrize("value", [5, None, 1.5, ["1 + 1"], {"a": "1"}, "x" * 10 ** 6], ids=_short)
def test_an_argument_of_any_type_gets_an_error_answer(value):
    answer = evaluate(value)
    assert answer.startswith("error: expression ") and len(answer) < 200


def _fuzzed_turns(rng: random.Random) -> list[str]:
    """Turn texts with tool calls of every malformed kind (wrong types, huge payloads,
    invalid Unicode, deep nesting) and well-formed ones, shuffled together."""
    bodies = [
        "not json", "{", "[]", "null", '"calculate"', "{}", '{"name": 5}',
        '{"name": "calculate", "arguments": []}', '{"name": "calculate", "arguments": "1+1"}',
        '{"name": "calculate", "arguments": {"expression": 12}}',
        '{"name": "calculate", "arguments": {"expression": null}}',
        '{"name": "calculate", "arguments": {"expression": ["1"]}}',
        '{"name": "calculate", "arguments": {}}',
        '{"name": "calculate", "arguments": {"expression": "\\ud800"}}',
        '{"name": "calculate\\udcff", "arguments": {"expression": "1"}}',
        "\udcff\udcfe" + '{"name": "calculate"}',
        json.dumps({"name": "calculate", "arguments": {"expression": "9" * 100_000}}),
        json.dumps({"name": "x" * 100_000, "arguments": {}}),
        "[" * 50_000 + "]" * 50_000,
        '{"a":' * 20_000 + "1" + "}" * 20_000,
        "1" * 5000,
        json.dumps({"name": "calculate", "arguments": {"expression": "(2 + 3) * 4"}}),
    ]
    texts = [f"<tool_call>{b}</tool_call>" for b in bodies]
    texts += ["<tool_call>" + "<tool_call>".join(bodies[:3]), "</tool_call>" * 5, ""]
    rng.shuffle(texts)
    return texts


async def test_the_parser_and_the_calculator_answer_any_turn_text():
    env = CALC(None)
    for text in _fuzzed_turns(random.Random(1)):
        started = time.process_time()
        calls = hermes_tool_calls(text)  # never raises: a malformed call is the policy's
        step = await env.step(Turn(0, np.zeros(1, np.int32), text, calls, "stop"))
        if not calls:
            assert step.done and step.observation is None
            continue
        lines = step.observation.split("\n")
        assert len(lines) == len(calls)
        for call, line in zip(calls, lines):
            if call.error or call.name != "calculate":
                assert line.startswith("error: ")
            elif call.arguments.get("expression") == "(2 + 3) * 4":
                assert line == "20"
            else:
                assert line.startswith("error: "), line
        assert len(step.observation) < 2000 * len(calls)  # no huge payload echoed back
        assert time.process_time() - started < 1.0  # a hang guard


def test_the_parser_finds_the_blocks_the_regex_finds_in_linear_time():
    """The blocks are those of the plain regex (the naive reference), found without its
    quadratic retries: a policy that degenerates into repeating ``<tool_call>`` costs
    milliseconds, not minutes with the GIL held."""
    import re

    from replayrl.rollout.tasks.environment import _blocks

    reference = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    rng = random.Random(2)
    parts = ["<tool_call>", "</tool_call>", "a", "{}", "<tool", "_call>", "</", "\n"]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 12)))
        assert list(_blocks(text)) == reference.findall(text), text
    started = time.process_time()
    calls = hermes_tool_calls("<tool_call>" * 50_000)  # the regex: over a minute
    assert [c.error for c in calls] == ["unclosed <tool_call>"]
    assert time.process_time() - started < 0.5  # 0.001 s here


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
