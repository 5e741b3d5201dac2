"""An arithmetic calculator tool (``--env python_calculator``, or
``--env examples/environments/python_calculator.py:PythonCalculatorEnv``).

The policy calls ``<tool_call>{"name": "calculate", "arguments": {"expression": "37 * 41 + 5"}}
</tool_call>``; the environment answers with the value (a tool message), or ``error: ...``.

The expression is model-written, so untrusted. It is never given to ``eval``, ``exec`` or a
Python process: :func:`evaluate` parses it with :mod:`ast` (Python's grammar for arithmetic)
and computes the tree itself, accepting only

* number literals (``int`` / ``float``; no ``bool``, complex, string or bytes),
* the binary operators ``+ - * / // % **``, unary ``+`` / ``-`` and parentheses,

and refusing every other node by name before anything is computed (names, calls, attribute
access, subscripts, comprehensions, lambdas: so ``__import__('os')``, ``open(...)``,
``(1).__class__.__subclasses__()`` and ``eval`` reach nothing; there is nothing to reach).
Its cost is bounded before each operation rather than cut off afterwards:

* at most :data:`MAX_EXPRESSION_CHARS` characters and :data:`MAX_DEPTH` levels of nesting;
* an integer result of at most :data:`MAX_INT_BITS` bits: ``a ** b`` and ``a * b`` are refused
  when their result would be larger (estimated from the operands' bit lengths, so
  ``9 ** 9 ** 9`` is refused in microseconds, never computed);
* a float result must be finite (an overflow is an error, not ``inf``), and a result must be
  real (``(-8) ** 0.5`` is complex: refused).

So one call takes microseconds to a few milliseconds and a few KiB, whatever the text; the
environment runs on a worker thread under ``--env-timeout-seconds`` all the same
(``rollout/episodes/env_sessions.py``). docs/security.md ("Tools and environments") states
these guarantees and their limits.

The episode: a turn with a tool call gets the answer; a turn without one is the final answer
(``done``), which the task's verifier scores (e.g. ``--rm-type exact`` against the label).
Step reward 0 (``--env-reward verifier``).
"""
from __future__ import annotations

import ast
import math
import operator

from replayrl.rollout.tasks.environment import Step, ToolEnvironment, Turn, tool_result

MAX_EXPRESSION_CHARS = 500
MAX_DEPTH = 64
MAX_INT_BITS = 10_000  # about 3,000 decimal digits: below Python's 4,300-digit str() limit

TOOLS = ({"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string",
                                                 "description": "e.g. (3 + 4) * 12"}},
                   "required": ["expression"]}}},)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
           ast.Mod: "%", ast.Pow: "**"}


class UnsafeExpression(ValueError):
    """An expression outside the whitelisted arithmetic, or one whose result would exceed the
    bounds (the message names the construct or the bound)."""


def _parse(expression: str) -> ast.expr:
    """The tree of ``expression``, refused unless it is whitelisted arithmetic.

    Raises:
        UnsafeExpression: not a string, too long, not UTF-8-encodable, a syntax error, too
            deep, or a node / constant outside the whitelist (named).
    """
    if not isinstance(expression, str):
        raise UnsafeExpression(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"expression is {len(expression)} characters, over the "
                               f"{MAX_EXPRESSION_CHARS} allowed")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise UnsafeExpression(f"not an expression: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes, surrogates, nesting
        raise UnsafeExpression(f"not an expression: {type(exc).__name__}") from None
    stack = [(tree.body, 1)]
    while stack:  # iterative: a deep tree cannot exhaust the stack before it is refused
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise UnsafeExpression(f"expression nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            stack += [(node.left, depth + 1), (node.right, depth + 1)]
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            stack.append((node.operand, depth + 1))
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise UnsafeExpression(f"constant {node.value!r:.40} is not a number")
        else:
            what = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node).__name__
            raise UnsafeExpression(f"{what} is not allowed (arithmetic only)")
    return tree.body


def _bits(value: int | float) -> int:
    """The bit length of an integer (a float's integer part counts as 1024 at most)."""
    return abs(value).bit_length() if isinstance(value, int) else 1024


def _apply(op: type, left: int | float, right: int | float) -> int | float:
    """``left <op> right``, refused when an integer result would exceed :data:`MAX_INT_BITS`."""
    if isinstance(left, int) and isinstance(right, int):
        if op is ast.Pow and right > 0 and abs(left) > 1:
            # |left| ** right < 2 ** (bits(left) * right): refuse what could be over the bound
            if (abs(left).bit_length() - 1) * right >= MAX_INT_BITS:
                raise UnsafeExpression(f"{_SYMBOL[op]}: the result would have over "
                                       f"{MAX_INT_BITS} bits")
        elif op is ast.Mult and _bits(left) + _bits(right) > MAX_INT_BITS + 1:
            raise UnsafeExpression(f"*: the result would have over {MAX_INT_BITS} bits")
    value = _BINARY[op](left, right)
    return _checked(value, _SYMBOL[op])


def _checked(value: object, what: str) -> int | float:
    """``value`` if it is a finite real number within the bounds."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise UnsafeExpression(f"{what}: the result has over {MAX_INT_BITS} bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnsafeExpression(f"{what}: the result is not finite")
        return value
    raise UnsafeExpression(f"{what}: the result is not a real number")


def _compute(node: ast.expr) -> int | float:
    """The value of a tree :func:`_parse` accepted (depth at most :data:`MAX_DEPTH`)."""
    if isinstance(node, ast.Constant):
        return _checked(node.value, "literal")
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_compute(node.operand))
    return _apply(type(node.op), _compute(node.left), _compute(node.right))


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression, or why not.

    Args:
        expression: model-written text (untrusted; anything at all is safe to pass).
    Returns:
        ``repr`` of the value (``"1522"``, ``"3.5"``), or ``"error: ..."``: refused (the
        construct or bound named), a division by zero, an overflow. Never raises.
    """
    try:
        return repr(_compute(_parse(expression)))
    except UnsafeExpression as exc:
        return f"error: {exc}"
    except ZeroDivisionError:
        return "error: division by zero"
    except (OverflowError, ValueError) as exc:  # float overflow, int too large for a float
        return f"error: {type(exc).__name__}: {exc}"


class PythonCalculatorEnv(ToolEnvironment):
    """The calculator tool (see the module docstring): one ``calculate`` call per tool call."""

    tools = TOOLS

    async def step(self, turn: Turn) -> Step:
        """Answer every tool call of the turn (one line each); no call = the final answer."""
        if not turn.tool_calls:
            return Step(done=True)
        answers = []
        for call in turn.tool_calls:
            if call.error or call.name != "calculate":
                answers.append(tool_result(call, f"error: unknown tool {call.name!r:.80}"))
            else:
                answers.append(evaluate(call.arguments.get("expression", "")))
        return Step(observation="\n".join(answers))
