"""Prompt files (``--prompt-data``, ``--eval-prompt-data``): rows read, checked and tokenised.

A prompt file is JSONL (one JSON object per line; blank lines are not rows) or Parquet (read
with pyarrow, extra ``parquet``). Each row holds the prompt under ``--input-key`` (text, or a
list of ``{"role", "content"}`` messages for ``--apply-chat-template``), the label under
``--label-key`` (string or number) and optionally a JSON object under ``--metadata-key``. A row
that lacks a key or holds the wrong type is a :class:`PromptDataError` naming the file, the line
(row) and the key; nothing is skipped.

The built-in digit task is data of the same kind: its prompts ship as
``rollout/data/digits.jsonl`` (``rollout/tasks/digits.py``), tokenised by the embedded
word-level tokenizer like any user file. A run's training and refill prompts are its task's
(``rollout/tasks/``); its evaluation sets are prompt files whatever the task
(docs/design/prompt-data.md#prompt-data).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.errors import PromptDataError, TokenizerError
from replayrl.rollout.tasks import Task, make_task
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.text.tokenizer import PromptTokenizer
from replayrl.transport import strict_json

__all__ = ["PromptRow", "raw_rows", "read_rows", "tokenize_rows", "RunPrompts",
           "load_run_prompts"]


@dataclass(frozen=True)
class PromptRow:
    """One checked row of a prompt file.

    Attributes:
        source: ``"FILE:LINE"`` (JSONL line, or 1-based Parquet row).
        prompt: the prompt text, or a tuple of read-only chat messages.
        label: the label as text (numbers as JSON writes them).
        metadata: the row's metadata object (empty when the key is absent), read-only.
    """

    source: str
    prompt: str | tuple[Mapping[str, Any], ...]
    label: str
    metadata: Mapping[str, Any]


def raw_rows(path: Path) -> list[tuple[int, Any]]:
    """``(line, row)`` of every row of a JSONL / Parquet file, the rows as JSON / pyarrow give
    them (unchecked): a JSONL line number (blank lines are not rows) or a 1-based Parquet row.

    Raises:
        PromptDataError: the file is missing or unreadable, a line is not UTF-8 or not JSON
            (each names ``FILE`` or ``FILE:LINE``).
    """
    if not path.is_file():
        raise PromptDataError(f"{path}: no such prompt file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise PromptDataError(f"{path}: reading Parquet needs pyarrow "
                                  "(pip install 'replayrl[parquet]')") from exc
        try:
            return list(enumerate(pq.read_table(str(path)).to_pylist(), start=1))
        except Exception as exc:  # pyarrow's ArrowInvalid / OSError
            raise PromptDataError(f"{path}: not a readable Parquet file: {exc}") from None
    rows = []
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is named like any bad row
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PromptDataError(f"{path}:{line_no}: not UTF-8 text: {exc}") from None
            if not line.strip():
                continue
            try:
                rows.append((line_no, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise PromptDataError(f"{path}:{line_no}: not valid JSON: {exc}") from None
    return rows


def _prompt(value: Any, where: str, key: str) -> str | tuple[Mapping[str, Any], ...]:
    if isinstance(value, str):
        if not value.strip():
            raise PromptDataError(f"{where}: key {key!r} is an empty prompt")
        return value
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in value):
        return tuple(MappingProxyType(dict(m)) for m in value)
    raise PromptDataError(f"{where}: key {key!r} must be a non-empty string or a list of "
                          f"{{'role': str, 'content': str}} messages, got {value!r:.80}")


def read_rows(path: str | Path, input_key: str = "prompt", label_key: str = "label",
              metadata_key: str = "metadata") -> list[PromptRow]:
    """Every row of a JSONL / Parquet prompt file, checked.

    Raises:
        PromptDataError: the file is missing or unreadable, empty, a line is not JSON or not an
            object, the prompt or label is missing or of the wrong type, or the metadata is not
            an object (each names ``FILE:LINE`` and the key).
    """
    path = Path(path)
    rows = []
    for line, raw in raw_rows(path):
        where = f"{path}:{line}"
        if not isinstance(raw, dict):
            raise PromptDataError(f"{where}: a row must be a JSON object, got {type(raw).__name__}")
        if input_key not in raw:
            raise PromptDataError(f"{where}: missing key {input_key!r} (--input-key)")
        if label_key not in raw:
            raise PromptDataError(f"{where}: missing key {label_key!r} (--label-key)")
        label = raw[label_key]
        if isinstance(label, bool) or not isinstance(label, (str, int, float)):
            raise PromptDataError(f"{where}: key {label_key!r} must be a string or a number, "
                                  f"got {label!r:.80}")
        if isinstance(label, float) and not math.isfinite(label):
            raise PromptDataError(f"{where}: key {label_key!r} must be finite, got {label!r}")
        metadata = raw.get(metadata_key, {})
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise PromptDataError(f"{where}: key {metadata_key!r} must be a JSON object, got "
                                  f"{metadata!r:.80}")
        rows.append(PromptRow(where, _prompt(raw[input_key], where, input_key),
                              label if isinstance(label, str) else strict_json.dumps(label),
                              MappingProxyType(dict(metadata))))
    if not rows:
        raise PromptDataError(f"{path}: no rows")
    return rows


def tokenize_rows(rows: Sequence[PromptRow], tokenizer: PromptTokenizer, *, input_key: str,
                  vocab_size: int, max_prompt_len: int) -> list[Prompt]:
    """The rows as :class:`replayrl.rollout.text.data_source.Prompt` records, index = row position.

    Args:
        vocab_size: the policy's vocabulary; an id at or past it cannot be forwarded.
        max_prompt_len: longest prompt that leaves room for a response in the model's positions.

    Raises:
        PromptDataError: a prompt the tokenizer or template cannot encode, that encodes to an id
            outside the policy's vocabulary, or that is longer than ``max_prompt_len`` (names
            ``FILE:LINE`` and the key).
    """
    vocab = tokenizer.tokenizer.get_vocab()
    prompts = []
    for i, row in enumerate(rows):
        try:
            ids = tokenizer.encode_prompt(row.prompt)
        except TokenizerError as exc:  # kept as the cause: the launcher tells a user why
            raise PromptDataError(f"{row.source}: key {input_key!r}: {exc}") from exc
        if int(ids.max()) >= vocab_size:
            raise PromptDataError(f"{row.source}: key {input_key!r} encodes to id {int(ids.max())},"
                                  f" outside the policy's vocabulary of {vocab_size}")
        if len(ids) > max_prompt_len:
            raise PromptDataError(f"{row.source}: key {input_key!r} is {len(ids)} tokens; at most "
                                  f"{max_prompt_len} leave room for the response")
        prompts.append(Prompt(i, ids, int(vocab.get(row.label, -1)), row.label, row.metadata,
                              row.source))
    return prompts


@dataclass(frozen=True)
class RunPrompts:
    """The prompts of a run: training, replacement (refill) and evaluation sets.

    Attributes:
        train: the training prompts (the task's: ``--prompt-data`` or the built-in task).
        replacement: the prompts exact refill draws from (the task's: the built-in task's
            dataset for ``seed + 7919``; a prompt file: the same prompts, in their own order).
        evals: ``(name, prompts)`` of every ``--eval-prompt-data`` set, in order.
        name: how errors name the training data (the file, or ``"built-in digits"``).
    """

    train: list[Prompt]
    replacement: list[Prompt]
    evals: tuple[tuple[str, list[Prompt]], ...]
    name: str


def load_run_prompts(config: RolloutConfig, tokenizer: PromptTokenizer, *, vocab_size: int,
                     max_positions: int, task: Task | None = None) -> RunPrompts:
    """Read and tokenise every prompt set of a run (the launcher does it once before any
    process starts, so a bad row stops the run there; the manager again for its own use).

    Args:
        task: the run's task, whose prompts are the training and refill prompts; ``None`` =
            the one ``config`` selects (``replayrl.rollout.tasks.make_task``).
    Raises:
        PromptDataError: see :func:`read_rows` and :func:`tokenize_rows`.
        replayrl.rollout.errors.TaskConfigError: ``task`` is ``None`` and ``config`` selects no
            usable task.
    """
    if task is None:
        task = make_task(config)
    length = config.max_response_len
    own = task.prompts(tokenizer, vocab_size=vocab_size, max_prompt_len=max_positions - length)
    eval_length = config.eval_max_response_len or length
    evals = tuple((n, tokenize_rows(read_rows(f, config.input_key, config.label_key,
                                              config.metadata_key),
                                    tokenizer, input_key=config.input_key, vocab_size=vocab_size,
                                    max_prompt_len=max_positions - eval_length))
                  for n, f in config.eval_sets())
    return RunPrompts(own.train, own.replacement, evals, own.name)
