"""A Python-expression calculator tool (``--env python_calculator``, or
``--env examples/environments/python_calculator.py:PythonCalculatorEnv``).

The policy calls ``<tool_call>{"name": "calculate", "arguments": {"expression": "37 * 41 + 5"}}
</tool_call>``; the environment answers with the value (a tool message), or ``error: ...``.

Safety, in two layers:

* the expression is parsed with :mod:`ast` and refused unless every node is arithmetic on
  number literals (:data:`ALLOWED_NODES`: numbers, + - * / // % **, unary +/-, parentheses).
  Names, calls, attribute access, subscripts, strings, comprehensions and lambdas are refused
  before anything runs, so ``open(...)``, ``__import__('os')`` and ``(1).__class__`` never
  evaluate: there is no file or network access to reach;
* what is allowed runs in a fresh ``python -I -S`` subprocess with a CPU-time limit
  (``RLIMIT_CPU``, :data:`CPU_SECONDS`), an address-space limit (``RLIMIT_AS``,
  :data:`MEMORY_BYTES`) and a wall-clock timeout (:data:`WALL_SECONDS`), so a huge power
  (``9 ** 9 ** 9``) is killed, not computed. An exponent above :data:`MAX_EXPONENT` is refused
  up front as well.

The episode: a turn with a tool call gets the answer; a turn without one is the final answer
(``done``), which the task's verifier scores (e.g. ``--rm-type exact`` against the label).
Step reward 0 (``--env-reward verifier``).
"""
from __future__ import annotations

import ast
import asyncio
import resource
import sys

from replayrl.rollout.tasks.environment import Step, ToolEnvironment, Turn, tool_result

CPU_SECONDS = 1
MEMORY_BYTES = 256 * 2 ** 20
WALL_SECONDS = 3.0
MAX_EXPONENT = 10_000
MAX_EXPRESSION_CHARS = 500
ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub,
                 ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.UAdd, ast.USub)
_CHILD = ("import sys\n"
          "expr = sys.stdin.read()\n"
          "value = eval(compile(expr, '<calc>', 'eval'), {'__builtins__': {}}, {})\n"
          "print(repr(value))\n")

TOOLS = ({"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string",
                                                 "description": "e.g. (3 + 4) * 12"}},
                   "required": ["expression"]}}},)


class UnsafeExpression(ValueError):
    """An expression outside the whitelisted arithmetic (names the offending construct)."""


def check_expression(expression: str) -> ast.Expression:
    """Parse ``expression`` and refuse anything but arithmetic on number literals.

    Raises:
        UnsafeExpression: a syntax error, a node outside :data:`ALLOWED_NODES` (names it), a
            non-numeric constant, an expression over :data:`MAX_EXPRESSION_CHARS` characters,
            or a literal exponent over :data:`MAX_EXPONENT`.
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"expression must be a string of at most "
                               f"{MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise UnsafeExpression(f"not an expression: {exc.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, ALLOWED_NODES):
            raise UnsafeExpression(f"{type(node).__name__} is not allowed (arithmetic only)")
        if isinstance(node, ast.Constant) and (isinstance(node.value, bool)
                                               or not isinstance(node.value, (int, float))):
            raise UnsafeExpression(f"constant {node.value!r} is not a number")
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)
                and isinstance(node.right, ast.Constant) and abs(node.right.value) > MAX_EXPONENT):
            raise UnsafeExpression(f"exponent {node.right.value} is over {MAX_EXPONENT}")
    return tree


def _limits() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


async def evaluate(expression: str) -> str:
    """The value of a whitelisted arithmetic expression, computed in a limited subprocess.

    Returns:
        ``repr`` of the value, or ``"error: ..."`` (refused, raised in the child, or over the
        time / memory limits).
    """
    try:
        check_expression(expression)
    except UnsafeExpression as exc:
        return f"error: {exc}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-c", _CHILD, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=_limits)
    try:
        out, err = await asyncio.wait_for(proc.communicate(expression.encode()), WALL_SECONDS)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return "error: time limit"
    if proc.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or ["killed"]
        if proc.returncode < 0 or "MemoryError" in last[0]:
            return "error: time or memory limit"
        return f"error: {last[0]}"
    return out.decode().strip()


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
                answers.append(tool_result(call, f"error: unknown tool {call.name!r}"))
            else:
                answers.append(await evaluate(str(call.arguments.get("expression", ""))))
        return Step(observation="\n".join(answers))
