"""TokenMetadataTrace: the per-token traces of one trajectory, assembled chunk by chunk.

A multi-turn trajectory is captured in pieces: each engine turn returns a block of trace rows
(``sample_support`` rows for its response tokens, ``routed_experts`` / ``indexer_topk`` rows
for the positions it forwarded), and the environment inserts observation tokens that no engine
sampled. Concatenating those pieces by hand is where rows drift apart (docs/design/sample-contract.md#sample-contract:
every transformation keeps all per-token arrays aligned). This object owns that
concatenation for one row space (e.g. the ``R`` response rows, or the ``P + R - 1`` position
rows):

* the schema -- field names, trailing shape of each field, dtype int32 -- is fixed by the first
  :meth:`~TokenMetadataTrace.append` and every later chunk must match it exactly;
* :meth:`~TokenMetadataTrace.append_padding` adds rows of ``-1`` in every field, the trace
  convention for "nothing captured here" (observation tokens, a synthetic EOS): ``-1`` support
  rows are padding rows to the trainer, all ``-1`` routing / indexer rows keep the trainer's own
  choice (``rollout/model/qwen3_moe.py``);
* :meth:`~TokenMetadataTrace.finalize` checks the total row count against what the caller
  expects and hands out read-only arrays, exactly once.

Every error is a :class:`SampleError`, a :class:`replayrl.rollout.errors.SampleError` naming the sample
and the field.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from replayrl.rollout.errors import SampleError, TraceFinalizedError, TraceRowsError, TraceSchemaError

__all__ = [
    "INT32_MAX",
    "TokenMetadataTrace",
]

INT32_MAX = int(np.iinfo(np.int32).max)
"""The largest value an int32 trace, token id or route index can hold: the rollout side's
checks of traces (here), trajectories, single-turn batches and environment observations all
compare against this one bound."""


class TokenMetadataTrace:
    """Per-token int32 traces of one trajectory in one row space, built from chunks.

    Args:
        sample_id: the trajectory's id; every error message names it.

    Usage::

        trace = TokenMetadataTrace(sample_id=7)
        trace.append({"sample_support": turn0_support})   # [3, 1+W]
        trace.append_padding(4)                            # 4 observation rows of -1
        trace.append({"sample_support": turn1_support})   # [2, 1+W]
        fields = trace.finalize(9)                         # {"sample_support": int32 [9, 1+W]}

    Not thread-safe; one trace per trajectory and row space.
    """

    def __init__(self, sample_id: Any) -> None:
        self.sample_id = sample_id
        self._schema: dict[str, tuple[int, ...]] | None = None
        # ("rows", chunk dict) or ("pad", n); padding before the first chunk is kept symbolic
        # because the field shapes are not known yet.
        self._parts: list[tuple[str, Any]] = []
        self._rows = 0
        self._finalized = False

    @property
    def rows(self) -> int:
        """Rows appended so far (chunks and padding)."""
        return self._rows

    @property
    def schema(self) -> Mapping[str, tuple[int, ...]] | None:
        """Field name -> trailing shape (everything after the row axis); None before the first
        :meth:`append`. An empty mapping is a valid schema: a trajectory without any trace."""
        return None if self._schema is None else MappingProxyType(dict(self._schema))

    @property
    def finalized(self) -> bool:
        """True once :meth:`finalize` has returned."""
        return self._finalized

    def _fail(self, cls: type[SampleError], field: str, problem: str) -> SampleError:
        return cls(self.sample_id, field, problem)

    def _check_open(self, what: str) -> None:
        if self._finalized:
            raise self._fail(TraceFinalizedError, "<trace>", f"{what} after finalize")

    def _as_int32(self, name: str, value: Any) -> np.ndarray:
        try:
            arr = np.asarray(value)
        except Exception as exc:  # ragged nested lists and the like
            raise self._fail(TraceSchemaError, name, f"not an array: {exc}") from None
        if arr.ndim < 1:
            raise self._fail(TraceSchemaError, name, f"needs a row axis, got a {arr.ndim}-d value")
        if arr.dtype.kind not in "iu":
            raise self._fail(TraceSchemaError, name, f"dtype {arr.dtype} is not an integer dtype "
                                                     f"(traces are int32 ids)")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            # -1 is the only negative value a trace may hold ("nothing here"); anything below
            # is a corrupted capture, and values past int32 would wrap when cast.
            if lo < -1 or hi > INT32_MAX:
                raise self._fail(TraceSchemaError, name,
                                 f"values must lie in [-1, {INT32_MAX}], got [{lo}, {hi}]")
        return arr.astype(np.int32)  # always a fresh array: the caller keeps no mutable handle

    def append(self, chunk: Mapping[str, Any], *, rows: int | None = None) -> None:
        """Append one chunk of rows to every field.

        Args:
            chunk: field name -> integer array ``[n, ...]`` (values in ``[-1, 2**31)``, cast to
                int32 and copied). Every field must have the same ``n``. The first call fixes
                the schema (names and trailing shapes); later chunks must repeat it exactly.
            rows: the chunk's row count ``n``. Required for an empty ``chunk`` (a trajectory
                captured without traces still counts its rows); otherwise checked against the
                arrays.

        Raises:
            TraceFinalizedError: after :meth:`finalize`.
            TraceSchemaError: a field missing from or added to the schema, a different trailing
                shape, a non-integer dtype, or a value below ``-1`` / above int32 (names the
                field).
            TraceRowsError: fields with different row counts, or ``rows`` disagreeing with them.
        """
        self._check_open("append")
        if not isinstance(chunk, Mapping):
            raise self._fail(TraceSchemaError, "<chunk>",
                             f"expected a mapping of field -> array, got {type(chunk).__name__}")
        arrays = {str(name): self._as_int32(str(name), value) for name, value in chunk.items()}
        shapes = {name: arr.shape[1:] for name, arr in arrays.items()}
        if self._schema is not None:
            for name in sorted(set(self._schema) | set(shapes)):
                if name not in shapes:
                    raise self._fail(TraceSchemaError, name,
                                     "missing from this chunk; earlier chunks carry it")
                if name not in self._schema:
                    raise self._fail(TraceSchemaError, name,
                                     "not in the schema fixed by the first chunk "
                                     f"{sorted(self._schema)}")
                if shapes[name] != self._schema[name]:
                    raise self._fail(TraceSchemaError, name,
                                     f"trailing shape {shapes[name]} != schema {self._schema[name]}")
        counts = {name: arr.shape[0] for name, arr in arrays.items()}
        if rows is not None:
            if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 0:
                raise self._fail(TraceRowsError, "<rows>", f"rows must be an int >= 0, got {rows!r}")
            rows = int(rows)
        for name, n in counts.items():
            expected = rows if rows is not None else next(iter(counts.values()))
            if n != expected:
                what = "the rows argument" if rows is not None else f"field {next(iter(counts))!r}"
                raise self._fail(TraceRowsError, name, f"{n} rows, but {what} has {expected}")
        if not arrays and rows is None:
            raise self._fail(TraceRowsError, "<rows>",
                             "an empty chunk needs rows= (its row count cannot be inferred)")
        n = rows if rows is not None else next(iter(counts.values()))
        if self._schema is None:
            self._schema = shapes
        self._parts.append(("rows", arrays))
        self._rows += n

    def append_padding(self, n: int) -> None:
        """Append ``n`` rows of ``-1`` to every field (observation tokens, a synthetic EOS).

        Padding before the first :meth:`append` is allowed; it takes the schema's shapes once
        the first chunk arrives.

        Raises:
            TraceFinalizedError: after :meth:`finalize`.
            TraceRowsError: ``n`` is not an int >= 0.
        """
        self._check_open("append_padding")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise self._fail(TraceRowsError, "<padding>", f"padding rows must be an int >= 0, got {n!r}")
        if n:
            self._parts.append(("pad", int(n)))
            self._rows += int(n)

    def finalize(self, expected_rows: int) -> Mapping[str, np.ndarray]:
        """Concatenate everything appended; callable exactly once.

        Args:
            expected_rows: the row count the trajectory needs in this row space (``R`` for
                response rows, ``P + R - 1`` for position rows).

        Returns:
            Read-only mapping field -> read-only int32 array ``[expected_rows, *trailing]``;
            empty when the schema is empty or no chunk was ever appended (padding alone carries
            no field to pad).

        Raises:
            TraceFinalizedError: called a second time.
            TraceRowsError: the row count differs from ``expected_rows`` (the message names
                every field and both counts). The trace stays open, so the caller may inspect
                it; it is not finalized by a failed call.
        """
        self._check_open("finalize")
        if isinstance(expected_rows, bool) or not isinstance(expected_rows, (int, np.integer)):
            raise self._fail(TraceRowsError, "<expected_rows>",
                             f"expected_rows must be an int, got {expected_rows!r}")
        if self._rows != int(expected_rows):
            names = sorted(self._schema) if self._schema else ["<no field>"]
            raise self._fail(TraceRowsError, ", ".join(names),
                             f"{self._rows} rows appended, expected {int(expected_rows)}")
        out: dict[str, np.ndarray] = {}
        for name, trailing in (self._schema or {}).items():
            pieces = [part[name] if kind == "rows" else np.full((part, *trailing), -1, np.int32)
                      for kind, part in self._parts]
            arr = (np.concatenate(pieces, axis=0) if pieces
                   else np.empty((0, *trailing), np.int32))
            arr.flags.writeable = False
            out[name] = arr
        self._finalized = True
        self._parts = []  # the chunks now live in the output arrays only
        return MappingProxyType(out)
