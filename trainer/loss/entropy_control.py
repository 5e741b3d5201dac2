"""The entropy bonus's coefficient per optimizer step: a fixed one, a linear warmup, or
adaptive entropy control (the bonus only when the policy's entropy runs low).

A fixed bonus (``--entropy-coef``) keeps a run from collapsing onto a confident wrong answer,
but it also pulls against learning while the policy is still far from confident. The
controller follows Skywork-OR1's adaptive entropy control (He et al. 2025, "Skywork Open
Reasoner 1 Technical Report", section "Adaptive Entropy Control"): one coefficient, moved by a
fixed step after every optimizer step, up while the measured entropy is below a target and
down while it is above, kept within ``[0, ceiling]``; the bonus is applied only while the
entropy is below the target. docs/design/trainer-math.md#entropy-collapse has the measurements.

The warmup (``--entropy-coef-warmup-steps N``) scales either coefficient by ``k / N`` at the
``k``-th trained step (the step that makes policy version ``k``), up to 1 from step ``N`` on:
a near-uniform early policy needs no push towards entropy, and the bonus's per-token reward
(about ``beta log K`` on a support of ``K`` tokens) is then as large as the early GRPO
advantages it would drown (docs/design/trainer-math.md#entropy-warmup). A linear ramp, the
shape of a learning-rate warmup (Goyal et al. 2017, "Accurate, Large Minibatch SGD").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from replayrl.trainer.errors import TrainerConfigError


@dataclass
class EntropyControl:
    """The coefficient ``beta`` of the entropy bonus for the next optimizer step.

    With ``target`` 0 the coefficient is ``ceiling`` at every step (the fixed bonus). Otherwise
    it starts at 0 and after each step with a measured entropy ``H`` (nats; the trainer passes
    the step's ``surprisal_mean``, the mean ``-logp_prox`` of its sampled tokens, whose
    expectation is the entropy over the sampler's support):
    ``c <- clip(c + step if H < target else c - step, 0, ceiling)``, and the next step's bonus
    is ``c`` while ``H < target`` and 0 otherwise (the bonus never raises an entropy that is
    already above the target).

    Attributes:
        ceiling: the largest coefficient (``--entropy-coef``), ``>= 0``.
        target: the target entropy in nats (``--entropy-target``); 0 = a fixed coefficient.
        step: the change of the coefficient per optimizer step (``--entropy-coef-step``), ``> 0``.
        coef: the controller's coefficient ``c`` (state: saved with a checkpoint).
        below: whether the last measured entropy was below the target (state).
        warmup: the warmup's length in trained steps (``--entropy-coef-warmup-steps``); 0 = none
            (applied by :meth:`at`, from the trainer's policy version: no state of its own).

    Raises:
        TrainerConfigError: a negative or non-finite ceiling or target, a step ``<= 0``, or a
            negative warmup.
    """

    ceiling: float
    target: float = 0.0
    step: float = 0.005
    coef: float = 0.0
    below: bool = False
    warmup: int = 0

    def __post_init__(self) -> None:
        for name in ("ceiling", "target"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise TrainerConfigError(f"entropy control: {name} must be finite and >= 0, "
                                         f"got {value!r}")
        if not (math.isfinite(self.step) and self.step > 0):
            raise TrainerConfigError(f"entropy control: step must be finite and > 0, got {self.step!r}")
        if self.warmup < 0:
            raise TrainerConfigError(f"entropy control: warmup must be >= 0 steps, got {self.warmup!r}")

    @property
    def bonus(self) -> float:
        """The fixed or adaptive coefficient for the next step, before the warmup (float, >= 0)."""
        if not self.target:
            return self.ceiling
        return self.coef if self.below else 0.0

    def at(self, version: int) -> float:
        """``beta`` for the next step's loss when the trainer holds policy version ``version``
        (its count of applied optimizer steps: a skipped step leaves it, a checkpoint restores
        it): :attr:`bonus` x ``min(1, (version + 1) / warmup)``, ``bonus / warmup`` at the first
        step (float, >= 0)."""
        if not self.warmup:
            return self.bonus
        return self.bonus * min(1.0, (version + 1) / self.warmup)

    def observe(self, entropy: float | None) -> None:
        """Move the coefficient after a step whose mean support entropy was ``entropy`` nats
        (None: the step measured none, e.g. it was skipped; nothing changes)."""
        if not self.target or entropy is None or not math.isfinite(entropy):
            return
        self.below = entropy < self.target
        moved = self.coef + (self.step if self.below else -self.step)
        self.coef = min(max(moved, 0.0), self.ceiling)

    def state_dict(self) -> dict:
        """The controller's state (``coef``, ``below``), for a checkpoint."""
        return {"coef": self.coef, "below": self.below}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (a missing key keeps the fresh value)."""
        self.coef = float(state.get("coef", self.coef))
        self.below = bool(state.get("below", self.below))
