"""What the REPL prints: an actor's methods with their docstrings, metrics rows, one sample's
traces (docs/design/multi-host.md#attach-and-multi-host).

Pure functions from plain data (an :class:`replayrl.actors.ActorInterface`, metrics rows, the columns of
``RolloutManager.last_sample``) to text, and :class:`Shown`, the value the console helpers
return: its ``repr`` is the text, ``.value`` the data.
"""
from __future__ import annotations

import difflib
import json
import textwrap
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from replayrl.actors import ActorInterface
from replayrl.tools.errors import MetricKeyError

__all__ = [ "Shown", "methods_text", "metrics_rows", "metrics_text", "sample_text"]

TRACE_NAMES = ("sample_support", "routed_experts", "indexer_topk")
"""The trace columns of a sample (``replayrl.rollout.sample.TRACE_FIELDS``; named here, not imported:
the console reads them from the wire, as plain arrays)."""

METRIC_KEYS = ("step", "trainer_version", "reward_mean", "staleness_max", "samples",
               "response_len_mean", "step_seconds")
"""Columns :func:`metrics_text` shows by default."""


class Shown:
    """A console result: ``repr`` shows ``text``; ``value`` holds the data it was made from."""

    __slots__ = ("text", "value")

    def __init__(self, text: str, value: Any) -> None:
        self.text = text
        self.value = value

    def __repr__(self) -> str:
        return self.text


def methods_text(interface: ActorInterface, docs: bool = True) -> str:
    """``name (Class)`` then one line per method signature, each followed by its docstring's
    first paragraph, indented (``docs=False``: signatures only)."""
    lines = [f"{interface.actor} ({interface.actor_class})"]
    for name in sorted(interface.texts):
        lines.append(f"  {interface.texts[name]}")
        doc = interface.docs.get(name, "").split("\n\n", 1)[0].strip()
        if docs and doc:
            lines.append(textwrap.indent(textwrap.fill(" ".join(doc.split()), 88), "      "))
    return "\n".join(lines)


def metrics_rows(path: str | Path, n: int) -> list[dict]:
    """The last ``n`` rows of a ``metrics.jsonl`` (a line still being written is left out).

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``n < 1``, or a complete line that is not JSON (names the line).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    text = Path(path).read_text()
    lines = text.split("\n")[:-1]  # the part after the last newline may be half written
    rows = []
    for number, line in enumerate(lines[-n:], start=max(1, len(lines) - n + 1)):
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            raise ValueError(f"{path} line {number}: not JSON: {exc}") from None
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def metrics_text(rows: Sequence[dict], keys: str | Sequence[str] | None = None) -> str:
    """A fixed-width table of ``step`` and ``keys`` (``-`` where a row lacks one), one line per
    row; ``step`` is always the first column (a row means nothing without it).

    Args:
        rows: metrics rows (dicts), oldest first.
        keys: one key (a ``str``) or several; ``None`` = :data:`METRIC_KEYS`, shown whether or
            not the rows have them.
    Raises:
        MetricKeyError: a key given in ``keys`` is in none of ``rows`` (the message names it,
            with the close matches among the rows' keys, or all of them when none is close).
    """
    if keys is None:
        keys = METRIC_KEYS
    else:
        # a bare string is one key: iterating it would make a column of each letter
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        if rows:
            _check_keys(keys, rows)
    if not rows:
        return "(no step recorded yet)"
    keys = ["step", *(k for k in keys if k != "step")]
    table = [list(keys)] + [[_cell(row.get(k)) for k in keys] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(keys))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table)


def _check_keys(keys: Sequence[str], rows: Sequence[dict]) -> None:
    known = sorted({k for row in rows for k in row})
    unknown = [k for k in keys if k != "step" and k not in known]
    if not unknown:
        return
    # the same hint as a misspelt actor method (actors/interface.py ActorInterface.check_call)
    hints, listed = [], False
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=3, cutoff=0.7)
        if close:
            hints.append(f"{key!r}: did you mean {' or '.join(map(repr, close))}?")
        elif not listed:
            hints.append(f"the rows' keys: {', '.join(known)}")
            listed = True
    hint = "; ".join(hints)
    raise MetricKeyError(f"no metrics row of the last {len(rows)} has key(s) "
                         f"{', '.join(map(repr, unknown))}; {hint}")


def _array_line(name: str, value: Any, rows: int) -> list[str]:
    array = np.asarray(value)
    head = f"  {name}: {array.dtype} {list(array.shape)}"
    if array.ndim == 0 or array.size == 0:
        return [head + f" = {array.tolist()}"]
    body = np.array2string(array[:rows], threshold=64, edgeitems=3, max_line_width=88)
    more = f"  ... {len(array) - rows} more rows" if len(array) > rows else ""
    return [head, textwrap.indent(body, "    ") + more]


def sample_text(columns: dict, rows: int = 4) -> str:
    """One sample (``RolloutManager.last_sample`` columns) as text: ids, version, reward, status,
    its token arrays and, for every trace it carries, dtype, shape and the first ``rows`` rows.

    Raises:
        KeyError: a column of the sample contract is missing.
    """
    if not columns:
        return "(no sample generated yet)"
    scalar = {k: np.asarray(columns[k]).reshape(-1)[0].item()
              for k in ("sample_id", "group_id", "rollout_id", "policy_version", "reward")}
    lines = [", ".join(f"{k} {v}" for k, v in scalar.items()) + f", status {columns['status'][0]}"]
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"):
        lines += _array_line(name, columns[name], 16)
    traces = [name for name in TRACE_NAMES if columns.get(name) is not None]
    lines.append("traces: " + (", ".join(traces) if traces else "none captured"))
    for name in traces:
        lines += _array_line(name, columns[name], rows)
    return "\n".join(lines)
