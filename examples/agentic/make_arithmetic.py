"""Arithmetic the policy cannot do alone: products of two three-digit numbers, answered with
the calculator tool (examples/environments/python_calculator.py, ``--env python_calculator``).

    python examples/agentic/make_arithmetic.py /tmp/agentic/arithmetic [--sft 256 --rl 64 --seed 0]

Writes ``sft.jsonl`` (demonstrations: call ``calculate`` with the product, copy its answer;
the answer is the calculator's own ``evaluate``) and ``rl.jsonl`` (``{"prompt", "label"}``
with the product as the label, for ``--rm-type exact``). No pair of factors is in both files.
``--no-tool`` writes the baseline's demonstrations instead: the product answered at once, no
tool call and no tool schema; ``rl.jsonl`` is the same as without it (same ``--seed``).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from common import demonstration, direct_answer, load_environment_module, tool_call, write

QUESTION = "Use the calculate tool, then answer with the number only: {a} * {b}"


def pairs(n: int, rng: random.Random) -> list[tuple[int, int]]:
    """``n`` distinct pairs of three-digit factors."""
    seen: set[tuple[int, int]] = set()
    while len(seen) < n:
        seen.add((rng.randint(100, 999), rng.randint(100, 999)))
    out = sorted(seen)
    rng.shuffle(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """Write the two files (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sft", type=int, default=256, help="demonstrations (default 256)")
    parser.add_argument("--rl", type=int, default=64, help="RL prompts (default 64)")
    parser.add_argument("--no-tool", action="store_true",
                        help="demonstrations that answer without the tool (the baseline)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    calculator = load_environment_module("python_calculator")
    both = pairs(args.sft + args.rl, random.Random(args.seed))  # distinct: the split is disjoint
    sft = []
    for a, b in both[:args.sft]:
        expression = f"{a} * {b}"
        value = calculator.evaluate(expression)
        if args.no_tool:
            sft.append(direct_answer(QUESTION.format(a=a, b=b), value))
            continue
        sft.append(demonstration(QUESTION.format(a=a, b=b),
                                 tool_call("calculate", {"expression": expression}),
                                 value, value, calculator.TOOLS))
    rl = [{"prompt": QUESTION.format(a=a, b=b), "label": str(a * b)} for a, b in both[args.sft:]]
    write(args.out, sft, rl)


if __name__ == "__main__":
    main()
