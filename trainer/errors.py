"""Typed errors of the trainer layer (docs/design/errors.md#errors).

Every error the trainer raises derives from :class:`TrainerError`. What a caller catches:

- a setting refused before the run starts (a ``ValueError``): :class:`TrainerConfigError`
  (trainer and rejection-sampling flags), :class:`UnknownBackendError`,
  :class:`MegatronModelError`, :class:`CompatError`;
- bad input to one computation (a ``ValueError``; the message names the field, the sample or the
  row): :class:`AdvantageError`, :class:`LossError`, :class:`LogprobError`,
  :class:`PackingError`, :class:`ReplayError`, :class:`RSError`, :class:`RefillConfigError`,
  :class:`RankGroupError`, and the checkpoint / weight-map mismatches
  :class:`CheckpointLayoutError`, :class:`WeightMapError`;
- a step refused at run time, weights untouched: :class:`TrainStepError` (a ``RuntimeError``),
  :class:`ReplayMismatch`, :class:`ReplayTargetError`, :class:`RefillExhausted`,
  :class:`ProximalCacheError`.

A sample that breaks the data contract is a :class:`replayrl.rollout.errors.SampleError`, except
inside the packed layout, where it is a :class:`PackedFieldError` (same message form).
"""
from __future__ import annotations

from typing import Any

__all__ = [
    "TrainerError", "TrainerConfigError", "UnknownBackendError", "MegatronModelError",
    "CompatError", "AdvantageError", "LossError", "LogprobError", "SupportError", "PackingError",
    "PackedFieldError", "ReplayError", "ReplayMismatch", "ReplayTargetError", "RSError", "RSBoundsError",
    "RefillConfigError", "RefillExhausted", "RankGroupError", "CheckpointLayoutError",
    "WeightMapError", "TrainStepError", "EmptyStep", "ProximalCacheError",
]


class TrainerError(Exception):
    """Base class of every trainer-layer error."""


# --- settings refused before the run starts -------------------------------------------------------

class TrainerConfigError(TrainerError, ValueError):
    """An unsupported trainer setting, rejection-sampling settings included; the message names
    the flag(s)."""


class UnknownBackendError(TrainerError, ValueError):
    """A backend name that is not in :data:`replayrl.trainer.backends.BACKENDS`; the message lists
    the known names."""


class MegatronModelError(TrainerError, ValueError):
    """A model or parallel layout the megatron backend cannot build; names the field."""


class CompatError(TrainerError, ValueError):
    """An unknown megatron CPU-compat item name, or an item switched off after it was applied."""


# --- bad input to one computation ---------------------------------------------------------------

class AdvantageError(TrainerError, ValueError):
    """Bad input to an advantage estimator (shape, group size, non-finite reward)."""


class LossError(TrainerError, ValueError):
    """Bad input to a loss (shapes, mask values, hyper-parameters, non-finite loss-token input)."""


class LogprobError(TrainerError, ValueError):
    """Bad input to a trainer logprob path (shapes, dtypes, temperature, chunk size)."""


class SupportError(LogprobError):
    """A ``sample_support`` row is inconsistent; the message names the row index."""


class PackingError(TrainerError, ValueError):
    """Bad input to the packing layout: lengths, multiples, CP size / rank, packed shapes."""


class PackedFieldError(PackingError):
    """A per-sample array does not fit the packed layout; names the sample and the field.

    The message reads ``sample <id>: field '<name>': <problem>`` as a
    :class:`replayrl.rollout.errors.SampleError`'s does.

    Attributes:
        sample_id: the sample (its id, or ``#i`` for the i-th segment without ids).
        field: the field name.
    """

    def __init__(self, sample_id: Any, field_name: str, problem: str) -> None:
        self.sample_id = sample_id
        self.field = field_name
        super().__init__(f"sample {sample_id}: field {field_name!r}: {problem}")


class ReplayError(TrainerError, ValueError):
    """Bad input to a replay check or manager: layer ids, trace shapes, SP rank, thresholds."""


class ReplayMismatch(ReplayError):
    """The replayed choices disagree with the layers' own choices beyond the allowed bounds.

    Attributes:
        check: the :class:`replayrl.trainer.replay.checks.ReplayCheck` that failed (overlaps,
            fractions, first mismatches).
    """

    def __init__(self, kind: str, check: Any, min_overlap_ratio: float,
                 max_mismatch_fraction: float) -> None:
        self.check = check
        listed = "; ".join(f"token {m.token} layer {m.layer}: used {list(m.used)} own {list(m.own)}"
                           for m in check.mismatches)
        super().__init__(
            f"{kind} replay mismatch: min per-token overlap {check.min_overlap:.3f} "
            f"(allowed >= {min_overlap_ratio}), {check.mismatched_tokens}/{check.n_tokens} tokens "
            f"with a mismatch = {check.mismatch_fraction:.3f} (allowed <= {max_mismatch_fraction}); "
            f"first mismatches: {listed}")


class RSError(TrainerError, ValueError):
    """Bad input to an RS gate (shapes, mask values, non-finite ratio at a loss token)."""


class RSBoundsError(RSError):
    """Gate bounds that cannot define an acceptance interval."""


class RefillConfigError(TrainerError, ValueError):
    """Bad exact-refill planner input: a non-positive size, a negative deficit, an inconsistent
    round."""


class RankGroupError(TrainerError, ValueError):
    """A rank layout or a batch that does not fit the trainer ranks; names the field."""


class CheckpointLayoutError(TrainerError, ValueError):
    """A checkpoint saved under another parallel layout, or by another trainer backend."""


class WeightMapError(TrainerError, ValueError):
    """A weight set whose names or shapes do not match the model; names the parameter."""


# --- a step refused at run time, weights untouched ------------------------------------------------

class TrainStepError(TrainerError, RuntimeError):
    """A step could not run; raised before the optimizer step, weights untouched."""


class EmptyStep(TrainStepError):
    """A step with nothing to train under ``--stop-on-empty-step``; nothing was applied."""


class ReplayTargetError(TrainerError, RuntimeError):
    """A routing replay armed for one model finds that a router of that model no longer holds
    its replay instance (another replay took the router, or the model's layers were swapped):
    the replay would miss the live routers. Raised before the forward.

    Attributes:
        layer: the global layer id (0-based) of the first router that does not match.
    """

    def __init__(self, layer: int, problem: str) -> None:
        self.layer = layer
        super().__init__(f"routing replay: layer {layer}: {problem}")


class RefillExhausted(TrainerError):
    """Still short of the target after ``max_rounds`` replacement rounds.

    Raised before the optimizer step, so weights and optimizer state stay unchanged.
    Attributes: ``target_groups``, ``admitted`` (group ids admitted so far), ``rounds``.
    """

    def __init__(self, target_groups: int, admitted: tuple, rounds: int):
        self.target_groups, self.admitted, self.rounds = target_groups, admitted, rounds
        super().__init__(
            f"exact refill exhausted: {len(admitted)} of {target_groups} prompt groups admitted "
            f"after {rounds} replacement round(s), the maximum; refusing the optimizer step"
        )


class ProximalCacheError(TrainerError, RuntimeError):
    """Cache over its byte cap, or a lookup of a sample that is not cached (named)."""
