"""The one engine interface: what every rollout engine (embedded, vLLM, SGLang, ...) provides.

An engine generates *turns*: one batched call, one :class:`Generation` per prompt. Multi-turn
loops, tool environments, trajectory assembly and rewards live on the rollout side
(``rollout/episodes/turn_loop.py``, ``rollout/dispatch/manager.py``), so an engine only has to:

* :meth:`Engine.load_weights` -- load a full weight set of a policy version;
* :meth:`Engine.generate` -- sample one response per prompt and capture the requested traces;
* report its :attr:`Engine.version` (``None`` before the first load) and, as the class attribute
  :attr:`Engine.capturable_traces`, which traces it can capture at all.

The rule "an engine serves no request before its first weight load of the run"
(docs/design/version-clock.md#version-clock) is enforced here, once, for every engine:
:meth:`Engine.generate` raises
:class:`EngineNotReady` until :meth:`Engine.load_weights` succeeded. Subclasses implement
:meth:`Engine._load_weights` and :meth:`Engine._generate` and never see a request before that.

How a push reaches :meth:`Engine.load_weights` is the weight sync's business
(:mod:`replayrl.rollout.weight_sync`). An engine whose own server receives pushes (the SGLang
client) may also offer ``load_weights_from_disk(path, version=)``,
``init_weights_update_group(spec)``, ``load_weights_from_distributed(manifest, version=)`` and
``destroy_weights_update_group(name)``, which the disk and dist syncs then call instead of
handing it tensors; each sets the version through :meth:`Engine._load_version`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Collection, Literal, Mapping, Sequence

import numpy as np

from replayrl.rollout.errors import EngineCaptureError, EngineInputError, EngineNotReady
from replayrl.rollout.sample import TRACE_FIELDS, pack_rows, unpack_rows
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.rollout.traces import trace_storage, trace_table
from replayrl.rollout.traces.trace_table import trace_fields

__all__ = [
    "Generation",
    "generations_to_columns",
    "generations_from_columns",
    "Engine",
    "check_capture",
]


@dataclass(frozen=True, eq=False)  # eq on arrays would be ambiguous; compare fields explicitly
@trace_fields(before="finish_reason")
class Generation:
    """One generated turn of one trajectory (numpy arrays, read-only).

    ``P`` = prompt (context) length, ``R`` = response length (``1 <= R <= max_new_tokens``),
    ``W`` = ``params.support_width(vocab_size)``. Trace rows cover the ``P + R - 1`` forwarded
    tokens (the last sampled token is never forwarded): rows ``0..P-1`` come from the prefill,
    row ``P + k`` from the decode step that forwarded response token ``k`` (``k < R - 1``).

    Fields:
        response_ids: int32 ``[R]``; ends with EOS when ``finish_reason == "stop"``.
        rollout_logprobs: float32 ``[R]``; behaviour logprob of each sampled token under the
            processed distribution (``z_y - logsumexp`` over its support row), finite.
        sample_support: int32 ``[R, 1 + W]``; col 0 sampled id, cols 1.. top-W candidates in
            descending logit order, ``-1`` = removed by top-p / min-p; ``None`` when not
            requested.
        routed_experts: int32 ``[P + R - 1, L_moe, K]`` expert ids per MoE layer
            (``config.moe_layers`` order), or ``None`` when not requested / no MoE layer.
        indexer_topk: int32 ``[P + R - 1, L_idx, index_topk]`` selected key *positions* in this
            trajectory (0 = first prompt token), ``-1`` = no key; or ``None`` when not
            requested / indexer off.
        (one such field per row of ``replayrl.rollout.traces.trace_table.TRACES``: keyword-only,
        default ``None`` = not captured; response-row traces have ``R`` rows, position-row
        traces ``P + R - 1``)
        finish_reason: ``"stop"`` (EOS sampled, included in ``response_ids``) or ``"length"``
            (``max_new_tokens`` reached without EOS).
    """

    response_ids: np.ndarray
    rollout_logprobs: np.ndarray
    finish_reason: Literal["stop", "length"]

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what crosses the wire; arrays travel out of band)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> "Generation":
        """Inverse of :meth:`to_dict` (values are taken as they are; ``merge_turns`` checks them).

        Raises:
            EngineInputError: a field is missing or unknown.
        """
        names = {f.name for f in fields(cls)}
        if set(record) != names:
            raise EngineInputError(f"Generation fields {sorted(record)} != {sorted(names)}")
        return cls(**record)


_TOKEN_FIELDS = ("response_ids", "rollout_logprobs")


def _array_fields() -> tuple[str, ...]:
    return (*_TOKEN_FIELDS, *(row.name for row in trace_table.TRACES))


def generations_to_columns(generations: Sequence[Generation]) -> dict[str, Any]:
    """One engine reply's generations as one array per field (what crosses the wire).

    ``N`` generations travel as about eight arrays instead of up to five each (640 for the
    default batch), whose per-array encode / decode cost dominated the reply. Layout:
    ``response_lengths`` / ``trace_lengths`` int64 ``[N]`` (``R`` and ``P + R - 1``),
    ``finish_reason`` list of ``N`` str, and per array field the generations' rows
    concatenated in order (``None`` when no generation has it; a list of ``N`` arrays or
    ``None`` when presence or trailing shapes differ), a trace stored as its table row's
    ``storage`` says (``replayrl.rollout.traces.trace_storage``; indexer rows come back as the same key
    sets, ascending). Inverse: :func:`generations_from_columns`.
    """
    cols: dict[str, Any] = {"finish_reason": [g.finish_reason for g in generations],
                            "response_lengths": np.array([len(g.response_ids) for g in generations],
                                                         dtype=np.int64)}
    position = [row.name for row in trace_table.TRACES if row.rows == "position"]
    trace_rows = [next((len(t) for t in (getattr(g, name) for name in position) if t is not None), 0)
                  for g in generations]
    cols["trace_lengths"] = np.array(trace_rows, dtype=np.int64)
    for name in _array_fields():
        cols[name] = pack_rows([getattr(g, name) for g in generations])
    for row in trace_table.TRACES:
        counts = cols["response_lengths"] if row.rows == "response" else cols["trace_lengths"]
        cols[row.name] = trace_storage.encode_column(row, cols[row.name], counts)
    return cols


def generations_from_columns(columns: Mapping[str, Any]) -> list[Generation]:
    """Rebuild the generations of :func:`generations_to_columns` (arrays are views into the
    columns; ``replayrl.rollout.traces.trajectory.merge_turns`` checks their contents).

    Raises:
        EngineInputError: a missing or unknown column, or a column whose rows disagree with
            the lengths (named by the column).
    """
    array_fields = _array_fields()
    names = {"finish_reason", "response_lengths", "trace_lengths", *array_fields}
    if not isinstance(columns, Mapping) or set(columns) != names:
        got = sorted(columns) if isinstance(columns, Mapping) else type(columns).__name__
        raise EngineInputError(f"generation columns {got} != {sorted(names)}")
    lengths = {}
    for name in ("response_lengths", "trace_lengths"):
        arr = columns[name]
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in "iu" or (arr < 0).any():
            raise EngineInputError(f"generation column {name!r}: expected non-negative integers [N]")
        lengths[name] = arr.tolist()
    n = len(lengths["response_lengths"])
    if len(lengths["trace_lengths"]) != n or len(columns["finish_reason"]) != n:
        raise EngineInputError(f"generation columns: {n} response lengths but "
                               f"{len(lengths['trace_lengths'])} trace lengths and "
                               f"{len(columns['finish_reason'])} finish reasons")
    split = {}
    response_rows = {*_TOKEN_FIELDS, *(row.name for row in trace_table.TRACES
                                       if row.rows == "response")}
    traces = {row.name: row for row in trace_table.TRACES}
    for name in array_fields:
        counts = lengths["response_lengths" if name in response_rows else "trace_lengths"]
        try:
            value = columns[name]
            if name in traces:
                value = trace_storage.decode_column(traces[name], value, counts)
            split[name] = unpack_rows(value, counts)
        except ValueError as exc:
            raise EngineInputError(f"generation column {name!r}: {exc}") from None
    return [Generation(**{name: split[name][i] for name in array_fields},
                       finish_reason=columns["finish_reason"][i]) for i in range(n)]


def check_capture(engine: type["Engine"], traces: Collection[str]) -> frozenset[str]:
    """``traces`` as a frozenset, checked against what ``engine`` can capture.

    Args:
        engine: an :class:`Engine` subclass.
        traces: trace field names (subset of ``replayrl.rollout.sample.TRACE_FIELDS``).

    Raises:
        EngineCaptureError: a name that is no trace, or a trace ``engine`` cannot capture
            (names the engine class and the trace).
    """
    wanted = frozenset(traces)
    unknown = sorted(wanted - set(TRACE_FIELDS))
    if unknown:
        raise EngineCaptureError(f"{engine.__name__}: unknown trace {unknown[0]!r}; known: "
                                 f"{TRACE_FIELDS}")
    missing = [name for name in TRACE_FIELDS
               if name in wanted and name not in engine.capturable_traces]
    if missing:
        raise EngineCaptureError(f"{engine.__name__} cannot capture trace {missing[0]!r} (it "
                                 f"captures {sorted(engine.capturable_traces)})")
    return wanted


class Engine(ABC):
    """A rollout engine: batched generation of turns with trace capture, at a weight version.

    Subclasses set :attr:`capturable_traces`, call ``super().__init__()`` and implement
    :meth:`_load_weights` and :meth:`_generate`. Constructor keyword arguments must be plain
    data (they travel to the engine actor's process through msgpack).

    Attributes:
        capturable_traces: the trace fields (``replayrl.rollout.sample.TRACE_FIELDS``) this engine can
            record at all; a run that requires another one is refused before it starts.
    """

    capturable_traces: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        self._version: int | None = None

    @classmethod  # noqa: B027  (an optional hook: the base accepts every model)
    def check_model(cls, model_config: Any) -> None:
        """Refuse, before any process starts, a policy this engine cannot serve as it is.

        Args:
            model_config: the policy's shape (a ``replayrl.rollout.model.config.ModelConfig``).

        Raises:
            EngineInputError: the engine would compute another model than the trainer's
                (the message names the engine and the feature). The base accepts every model.
        """

    @property
    def version(self) -> int | None:
        """Policy version of the loaded weights; ``None`` before the first load."""
        return self._version

    def load_weights(self, arrays: Mapping[str, Any], *, version: int) -> None:
        """Load a full weight set of policy ``version``.

        Args:
            arrays: parameter name -> floating numpy array / tensor (engine-specific keys).
            version: policy version of these weights, an int ``>= 0``, never below the loaded
                one (a failover that resets a counter must be loud).

        Raises:
            EngineInputError: ``version`` not an int ``>= 0`` or below the loaded version.
            Whatever :meth:`_load_weights` raises; the version is then left unchanged.
        """
        self._load_version(version, lambda: self._load_weights(arrays))

    def _load_version(self, version: int, load: Callable[[], None]) -> None:
        """Check ``version`` as :meth:`load_weights` does, run ``load()``, then serve
        ``version``: the one way a version is set, also for an engine that receives a push
        itself (the SGLang client's disk and weight-group loads).

        Raises:
            EngineInputError: ``version`` not an int ``>= 0`` or below the loaded version.
            Whatever ``load`` raises; the version is then left unchanged.
        """
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise EngineInputError(f"load_weights: version must be an int >= 0, got {version!r}")
        if self._version is not None and version < self._version:
            raise EngineInputError(f"load_weights: weight version would move backwards "
                                   f"{self._version} -> {version}")
        load()
        self._version = int(version)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_new_tokens: int,
        eos_token_id: int,
        seed: int,
        traces: Collection[str],
    ) -> list[Generation]:
        """Generate one turn per prompt, all prompts batched together.

        Args:
            prompts: ``B >= 1`` non-empty token-id sequences (the whole context of the turn).
            params: sampling parameters (see :mod:`replayrl.rollout.sampling.sampler`).
            max_new_tokens: response length cap, ``>= 1``.
            eos_token_id: id whose sampling finishes a row (``finish_reason == "stop"``).
            seed: seeds the call's sampling; same seed, prompts, params and weights give the
                same generations.
            traces: trace fields to capture (subset of :attr:`capturable_traces`); the others
                are ``None`` in every :class:`Generation`.

        Returns:
            ``B`` :class:`Generation` objects in prompt order.

        Raises:
            EngineNotReady: no weights loaded yet (checked first, for every engine).
            EngineCaptureError: a requested trace this engine cannot capture.
            EngineInputError (and engine-specific errors): see the subclass's :meth:`_generate`.
        """
        if self._version is None:
            raise EngineNotReady(f"{type(self).__name__}.generate called before the first "
                                 f"load_weights")
        wanted = check_capture(type(self), traces)
        return self._generate(prompts, params, max_new_tokens=max_new_tokens,
                              eos_token_id=eos_token_id, seed=seed, traces=wanted)

    @abstractmethod
    def _load_weights(self, arrays: Mapping[str, Any]) -> None:
        """Replace every weight; must leave the previous weights intact when it raises."""

    @abstractmethod
    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                  max_new_tokens: int, eos_token_id: int, seed: int,
                  traces: frozenset[str]) -> list[Generation]:
        """:meth:`generate` after the readiness and capture checks (same contract)."""
