"""Typed errors of the rollout layer (docs/design/errors.md#errors).

Every error the rollout layer raises derives from :class:`RolloutError`, so a driver can catch
the layer with one class. Below it the tree is shallow, grouped by what a caller does about it:

- bad input or a setting refused before anything runs (each also a :class:`ValueError`):
  :class:`RolloutConfigError`, :class:`TokenizerError`, :class:`PromptDataError`,
  :class:`RewardError`, :class:`TaskError`, :class:`ToolEnvError`, :class:`TurnLoopError`,
  :class:`SamplerError` (and its two kinds);
- an inference engine or its server failed: :class:`EngineError` and its kinds (each names the
  engine, the request or the field), :class:`EnginesLost` when no engine is left,
  :class:`WeightSyncError` when a weight push could not reach one;
- a run-time failure of one rollout step: :class:`RewardFailure`, :class:`DataExhausted`, and
  :class:`RolloutError` itself (the rollout manager's "no such rollout" / "already stored");
- a trajectory that violates the data contract: :class:`SampleError` and
  its kinds (:class:`CaptureError`, the trace errors), naming the sample and the field;
- the embedded model's errors: :class:`replayrl.rollout.model.errors.ModelError`.

Classes that subclass a builtin (``ValueError``, ``RuntimeError``, ``KeyError``, ...) do so
because callers and tests catch that builtin.
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "RolloutError", "RolloutConfigError", "TokenizerError", "PromptDataError", "RewardError",
    "RewardFailure", "DataExhausted", "TaskError", "TaskConfigError", "UnknownTask",
    "ToolEnvError", "TurnLoopError",
    "SamplerError", "SamplingParamsError", "NonFiniteLogitsError",
    "EngineError", "EngineNotReady", "EngineInputError", "EngineCaptureError", "EngineTimeout",
    "UnknownEngine", "EnginesLost", "WeightSyncError", "SglangRequestError", "SglangResponseError",
    "SglangUnavailable", "SglangNoAnswer",
    "SampleError", "MissingTraceError", "TrajectoryError", "TraceGapError", "MixedVersionError",
    "ChatTemplateError",
    "CaptureError", "TraceSchemaError", "TraceRowsError", "TraceFinalizedError",
]


class RolloutError(Exception):
    """Base class of every rollout-layer error; raised as itself when a rollout cannot be
    produced or handed over (no engine, a rollout id stored twice or not stored; names the id)."""


# --- bad input / settings refused before anything runs ------------------------------------------

class RolloutConfigError(RolloutError, ValueError):
    """An unsupported rollout setting; the message names the flag."""


class TokenizerError(RolloutError, ValueError):
    """A tokenizer directory or a prompt the tokenizer cannot serve (names the directory / flag)."""


class PromptDataError(RolloutError, ValueError):
    """A prompt file or row that cannot be used; the message names file, line and key."""


class ConversationError(PromptDataError):
    """A conversation that cannot be trained on.

    Attributes:
        reason: a short key counted by ``replayrl sft --skip-bad-rows``: ``malformed`` (not a
            list of message objects, or a field of the wrong type), ``unknown_role``,
            ``no_assistant``, ``too_long``, ``vocabulary`` (a token id the policy does not
            have) or ``template`` (the chat template cannot be cut into turns, see the module
            docstring).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RewardError(RolloutError, ValueError):
    """A reward that cannot be used as configured (e.g. the ``math`` extra is missing)."""


class TaskError(RolloutError, ValueError):
    """Bad task configuration or a token outside the task vocabulary."""


class TaskConfigError(RolloutError, ValueError):
    """A task that cannot run with the given settings, or no such task (the message names the
    flags or the registered names)."""


class UnknownTask(TaskConfigError, KeyError):
    """A task name that is not in ``replayrl.rollout.tasks.TASKS`` (the message lists the known
    names)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class ToolEnvError(RolloutError, ValueError):
    """A prompt or trajectory the tool environment cannot interpret (message names it)."""


class EnvironmentFailure(RolloutError, RuntimeError):
    """An environment (``--env``, ``rollout/tasks/environment.py``) raised, ran past
    ``--env-timeout-seconds``, answered something that is not a ``Step`` or gave an observation
    longer than the context left, under ``--env-failure error`` (the message names the
    environment, the prompt, the sample row and the turn); or, under any ``--env-failure``, so
    many of its timed-out calls never returned that the run ends (``"stranded"``,
    ``replayrl.rollout.episodes.env_worker.check_stranded``).

    Attributes:
        kind: ``"raised"``, ``"timeout"``, ``"malformed"``, ``"observation_too_long"`` or
            ``"stranded"``.
    """

    def __init__(self, message: str, kind: str = "raised") -> None:
        super().__init__(message)
        self.kind = kind


class CallExited(RolloutError, RuntimeError):
    """An environment call raised a ``BaseException`` that is not an ``Exception``
    (``SystemExit`` from ``sys.exit()``, ``KeyboardInterrupt``), kept as ``__cause__``: on the
    caller's loop it would end the run, so it fails only the call
    (``replayrl.rollout.episodes.env_worker.EnvWorker.call``)."""


class ToolCallParseFailed(RolloutError, ValueError):
    """An environment's ``parse_tool_calls`` raised (the cause): counted apart from its
    ``step``'s errors (``replayrl.rollout.episodes.env_sessions``)."""


class TurnLoopError(RolloutError, ValueError):
    """A :func:`replayrl.rollout.episodes.turn_loop.run_episodes` argument is malformed (the message
    names it)."""


class SamplerError(RolloutError, ValueError):
    """Base class of every error raised by the sampler (:mod:`replayrl.rollout.sampling.sampler`)."""


class SamplingParamsError(SamplerError):
    """A sampling parameter is outside its valid range (the message names the field)."""


class NonFiniteLogitsError(SamplerError):
    """A logit among the top-k candidates of a row is NaN or infinite (message names the row)."""


# --- run-time failures of a rollout step ----------------------------------------------------------

class RewardFailure(RolloutError, RuntimeError):
    """A reward call raised or ran over its time limit; the message names the sample."""


class DataExhausted(RolloutError, RuntimeError):
    """Every allowed epoch (``--num-epoch``) of the prompt data was drawn."""


# --- inference engines ----------------------------------------------------------------------------

class EngineError(RolloutError, RuntimeError):
    """Base class of every error raised by a rollout engine or the engine registry."""


class EngineNotReady(EngineError):
    """``generate`` was called before the first ``load_weights`` (docs/design/version-clock.md#version-clock:
    an engine serves no request before its first weight load)."""


class EngineInputError(EngineError, ValueError):
    """A ``generate`` / ``load_weights`` argument is malformed (message names the field)."""


class EngineCaptureError(EngineError, ValueError):
    """A trace was requested that the engine cannot capture, or the name is no trace at all
    (message names the engine and the trace)."""


class EngineTimeout(EngineError, TimeoutError):
    """vLLM did not start or answer in time; the engine is unusable afterwards (names the call)."""


class UnknownEngine(EngineError, KeyError):
    """An engine name that is not in :data:`replayrl.rollout.engines.ENGINES` (the message lists
    the known names)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class SglangRequestError(EngineError, ValueError):
    """The SGLang server refused a request (HTTP 4xx, or ``finish_reason`` abort): message names
    the URL, the request ids and the server's message. Not retried: resending would fail again."""


class SglangResponseError(EngineError, ValueError):
    """An SGLang reply lacks a requested field or holds one that cannot be a trace of this
    request (wrong length, off-by-one route rows, bad base64, ids outside their range), or the
    reply list does not match the request list, or its ``weight_version`` is not the version the
    engine pushed (names both). The message names the server or the request id
    and the field; nothing is filled in or clamped."""


class SglangUnavailable(EngineError, ConnectionError):
    """No SGLang server answered within the bounded retries (names every URL tried and why)."""


class SglangNoAnswer(EngineError):
    """One SGLang server did not answer (connection / timeout / 5xx, or an aborted request):
    the engine tries the next URL; it raises :class:`SglangUnavailable` when none is left."""


class EnginesLost(RolloutError, RuntimeError):
    """No engine is left to serve a rollout (every one lost under ``regenerate``, or none
    restored in time under ``restart``); names the engines and why each was lost."""


class WeightSyncError(RolloutError, RuntimeError):
    """A weight push could not be packed, delivered or loaded by its weight sync
    (:mod:`replayrl.rollout.weight_sync`): a payload of another sync or group, a broadcast that
    failed, CUDA IPC on tensors that are not on a CUDA device; names the sync and the push."""


# --- data contract: a trajectory that cannot be trained on (names the sample and the field) ------

class SampleError(RolloutError, ValueError):
    """A trajectory violates the contract; the message names the sample and the field
    (``sample_id`` and ``field`` are also attributes)."""

    def __init__(self, sample_id: Any, field_name: str, problem: str) -> None:
        self.sample_id = sample_id
        self.field = field_name
        super().__init__(f"sample {sample_id}: field {field_name!r}: {problem}")


class ChatTemplateError(SampleError):
    """A tool turn cannot be appended to a trajectory's exact ids as the chat template renders
    the whole conversation (the template rewrites earlier turns when a tool message is added,
    or puts the turn's end-of-turn token elsewhere); names the sample and the field."""


class MissingTraceError(SampleError):
    """A trace an enabled replay needs is absent from a sample (names the sample and the field)."""


class TrajectoryError(SampleError):
    """A trajectory transformation (truncation, synthetic EOS, merging turns) got inconsistent
    input (names the sample and the field)."""


class TraceGapError(SampleError):
    """A turn lacks a trace that earlier turns of the same trajectory carry."""


class MixedVersionError(SampleError):
    """The turns of one trajectory were served by different weight versions (names the sample)."""


class CaptureError(SampleError):
    """An external engine's capture cannot become a trace row (names the sample and the field)."""


class TraceShapeError(SampleError):
    """A trace's per-token shape (layer columns x top-k) is not the model's (names the sample,
    the field, both shapes)."""


class TraceSchemaError(SampleError):
    """A :class:`replayrl.rollout.traces.trace.TokenMetadataTrace` chunk's field names, trailing
    shapes, dtypes or values disagree with the schema."""


class TraceRowsError(SampleError):
    """Row counts of a trace disagree: inside one chunk, with a ``rows`` argument, or at
    finalize."""


class TraceFinalizedError(SampleError):
    """The trace was already finalized (append / append_padding / finalize called again)."""
