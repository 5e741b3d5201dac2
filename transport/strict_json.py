"""Strict JSON (RFC 8259) for every file and message the project writes as JSON.

Python's ``json`` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default; those are not JSON and
strict parsers (``jq``, JavaScript's ``JSON.parse``, Go, Rust's serde_json) refuse the whole
file. Every writer in the project goes through :func:`dumps`, which refuses them
(``allow_nan=False``) and names the offending key; a writer that has a meaning for a
non-finite value says so by mapping it first (an absent bound becomes ``null`` in the run
config, a metric with no finite value becomes ``null`` in ``metrics.jsonl``, see
:func:`finite_or_none`). :func:`loads` refuses them on the way in.
"""
from __future__ import annotations

import json
import math
from typing import Any

from replayrl.transport.errors import NonFiniteJSON

__all__ = [ "dumps", "loads", "finite_or_none"]


def _first_non_finite(obj: Any, path: str = "") -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return f"{path or '<top level>'} = {obj!r}"
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = _first_non_finite(value, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps(obj, allow_nan=False, **kwargs)``.

    Raises:
        NonFiniteJSON: ``obj`` holds a NaN or an infinity (the message names its key path).
        TypeError: ``obj`` holds something JSON cannot represent (as ``json.dumps``).
    """
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        where = _first_non_finite(obj)
        if where is None:
            raise
        raise NonFiniteJSON(f"not strict JSON: {where} (write null for a value that is not "
                            f"there)") from None


def _refuse_constant(name: str) -> Any:
    raise NonFiniteJSON(f"not strict JSON: {name}")


def loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses ``NaN`` / ``Infinity`` / ``-Infinity``.

    Raises:
        NonFiniteJSON: the text holds one of those constants.
        json.JSONDecodeError: the text is not JSON.
    """
    return json.loads(text, parse_constant=_refuse_constant)


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth of dicts / lists / tuples) replaced
    by ``None``: how a metric with no finite value (e.g. the mean of nothing) is recorded."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value
