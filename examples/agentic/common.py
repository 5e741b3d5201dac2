"""What both generators of this folder share: the example environments loaded from their files
(examples/environments/, not a package), the Hermes tool-call text the policy writes, and the
two files a generator writes.

A demonstration is one conversation in TRL's conversational format: the user's question, the
assistant's tool call, the tool's answer as the environment gives it, the assistant's final
answer copied from it. The tool call is the assistant's content in the Hermes / Qwen format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), the text a policy generates in
an ``--env`` rollout and the environment parses, so a template that renders content verbatim
(examples/environments/make_checkpoint.py's, Qwen's) trains the policy on the very text RL
samples. Each row carries the environment's tool schema (``tools``), which the template renders
as ``replayrl train`` renders it into every prompt. The no-tool baseline's rows
(:func:`direct_answer`) are the question and its answer alone.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ENVIRONMENTS = Path(__file__).resolve().parent.parent / "environments"


def load_environment_module(name: str):
    """``examples/environments/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ENVIRONMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool_call(name: str, arguments: dict) -> str:
    """The Hermes tool-call text of one call (the JSON layout the example checkpoint's merged
    tokens spell: ``{"name": "calculate", "arguments": {"expression": "`` ...)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def demonstration(question: str, call: str, observation: str, answer: str, tools) -> dict:
    """One SFT row: question, tool call, the tool's answer, the final answer."""
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": call},
                         {"role": "tool", "content": observation},
                         {"role": "assistant", "content": answer}],
            "tools": [json.loads(json.dumps(t)) for t in tools]}


def direct_answer(question: str, answer: str) -> dict:
    """One SFT row of the no-tool baseline: the question, then the answer at once (no tool
    call, no tool schema)."""
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]}


def write(out: Path, sft: list[dict], rl: list[dict]) -> None:
    """``out/sft.jsonl`` (the demonstrations) and ``out/rl.jsonl`` (``{"prompt", "label"}``
    rows, optionally ``metadata``), one JSON object a line."""
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("sft.jsonl", sft), ("rl.jsonl", rl)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out / 'sft.jsonl'} ({len(sft)} demonstrations) and {out / 'rl.jsonl'} "
          f"({len(rl)} prompts)")
