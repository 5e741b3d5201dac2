"""Exact-refill arithmetic: the replacement quantum, the replacement target and the rounds.

Exact refill (docs/design/rejection-sampling.md#exact-refill): prompt groups that fail the RS gate are dropped whole
and replaced by fresh groups generated at exactly the preflight policy version, for up to
``max_rounds`` replacement rounds; still short of the target, the step raises before the
optimizer runs. Replacement groups are requested in multiples of a quantum ``q`` so that every
replacement batch splits evenly over the data-parallel ranks (and, with virtual pipeline
stages, over a microbatch group): ``q`` groups hold ``q * n = lcm(A, n)`` samples, a multiple
of ``A``.

Everything here is pure: no actors, no clocks, no I/O. The refill coordinator drives a
:class:`RefillPlan` with the admission results of each round.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, replace

from replayrl.trainer.errors import RefillConfigError, RefillExhausted

__all__ = [
    "RefillRequest",
    "RefillPlan",
    "refill_quantum",
    "replacement_target",
    "plan_refill_rounds",
]

GroupId = Hashable


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RefillConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def refill_quantum(
    dp_size: int, n_samples_per_prompt: int, vpp_size: int, microbatch_group_size: int
) -> int:
    """Replacement quantum ``q`` in prompt groups: ``q = A / gcd(A, n)``.

    ``A = dp_size * (microbatch_group_size if vpp_size > 1 else 1)`` is the number of samples a
    batch must be a multiple of; ``q`` is the fewest whole groups of ``n`` samples whose sample
    count ``q * n = lcm(A, n)`` is a multiple of ``A``.

    Args:
        dp_size: data-parallel size (ranks).
        n_samples_per_prompt: samples per prompt group ``n``.
        vpp_size: virtual pipeline stages (1 = no VPP).
        microbatch_group_size: microbatches per VPP group (used only when ``vpp_size > 1``).

    Returns:
        ``q >= 1`` (groups).

    Raises:
        RefillConfigError: any argument not a positive int.

    Source: slime's RS refill sizing (divisibility of the refill batch over DP x VPP groups).
    """
    dp = _positive_int(dp_size, "dp_size")
    n = _positive_int(n_samples_per_prompt, "n_samples_per_prompt")
    vpp = _positive_int(vpp_size, "vpp_size")
    mgs = _positive_int(microbatch_group_size, "microbatch_group_size")
    a = dp * (mgs if vpp > 1 else 1)
    return a // math.gcd(a, n)


def replacement_target(deficit: int, quantum: int) -> int:
    """Replacement groups to request for a deficit: ``ceil(deficit / q) * q``.

    Args:
        deficit: missing prompt groups (``>= 0``).
        quantum: ``q`` from :func:`refill_quantum` (``>= 1``).

    Returns:
        groups to request (0 when the deficit is 0).

    Raises:
        RefillConfigError: a negative or non-int deficit, a non-positive quantum.
    """
    q = _positive_int(quantum, "quantum")
    if isinstance(deficit, bool) or not isinstance(deficit, int) or deficit < 0:
        raise RefillConfigError(f"deficit must be an int >= 0, got {deficit!r}")
    return -(-deficit // q) * q


@dataclass(frozen=True)
class RefillRequest:
    """Ask for ``n_groups`` replacement prompt groups at exactly the preflight version.

    Attributes:
        round: 1-based replacement round.
        n_groups: prompt groups to generate (a multiple of the quantum).
    """

    round: int
    n_groups: int


@dataclass(frozen=True)
class RefillPlan:
    """Immutable state of the exact-refill rounds of one optimizer step.

    Attributes:
        target_groups: prompt groups the step trains on (``rollout_batch_size``).
        quantum: replacement quantum ``q`` (groups).
        max_rounds: replacement rounds allowed after the initial round.
        admitted: group ids the step trains on, in admission order (initial groups first,
            then replacements in request order); exactly ``target_groups`` once done.
        rejected: group ids dropped whole by the gate, in order.
        surplus: replacement groups that passed but exceed the target (the quantum may
            overshoot); dropped, never trained on.
        rounds: replacement rounds requested so far.
        request: the outstanding :class:`RefillRequest`, or None when the plan is done.
    """

    target_groups: int
    quantum: int
    max_rounds: int
    admitted: tuple[GroupId, ...] = ()
    rejected: tuple[GroupId, ...] = ()
    surplus: tuple[GroupId, ...] = ()
    rounds: int = 0
    request: RefillRequest | None = None

    @property
    def deficit(self) -> int:
        """Prompt groups still missing."""
        return self.target_groups - len(self.admitted)

    @property
    def done(self) -> bool:
        """True once ``target_groups`` groups are admitted (no request outstanding)."""
        return self.deficit == 0

    def record(self, admission: Mapping[GroupId, bool]) -> RefillPlan:
        """Fold in the admission results of the outstanding replacement round.

        Args:
            admission: ``{group_id: admitted}`` for exactly the requested groups, in *request*
                order (the order decides which passing groups fill the deficit; completion
                order would favour short responses).

        Returns:
            the next plan: done, or with the next :class:`RefillRequest`.

        Raises:
            RefillConfigError: no request outstanding, the wrong number of groups, a group id
                seen before, or a non-bool result.
            RefillExhausted: still short after ``max_rounds`` replacement rounds.
        """
        if self.request is None:
            raise RefillConfigError("no replacement round is outstanding; the plan is done")
        if len(admission) != self.request.n_groups:
            raise RefillConfigError(
                f"round {self.request.round} requested {self.request.n_groups} groups but "
                f"{len(admission)} results arrived"
            )
        return _fold(self, admission)


def _fold(plan: RefillPlan, admission: Mapping[GroupId, bool]) -> RefillPlan:
    seen = set(plan.admitted) | set(plan.rejected) | set(plan.surplus)
    admitted, rejected, surplus = list(plan.admitted), list(plan.rejected), list(plan.surplus)
    for gid, ok in admission.items():
        if not isinstance(ok, bool):
            raise RefillConfigError(f"group {gid!r}: admission must be a bool, got {ok!r}")
        if gid in seen:
            raise RefillConfigError(f"group {gid!r} was already recorded in this step")
        seen.add(gid)
        if not ok:
            rejected.append(gid)
        elif len(admitted) < plan.target_groups:
            admitted.append(gid)
        else:
            surplus.append(gid)
    nxt = replace(plan, admitted=tuple(admitted), rejected=tuple(rejected),
                  surplus=tuple(surplus), request=None)
    if nxt.deficit == 0:
        return nxt
    if nxt.rounds >= nxt.max_rounds:
        raise RefillExhausted(nxt.target_groups, nxt.admitted, nxt.rounds)
    rnd = nxt.rounds + 1
    return replace(nxt, rounds=rnd,
                   request=RefillRequest(round=rnd, n_groups=replacement_target(nxt.deficit, nxt.quantum)))


def plan_refill_rounds(
    initial_admission: Mapping[GroupId, bool],
    *,
    target_groups: int,
    quantum: int,
    max_rounds: int,
) -> RefillPlan:
    """Start the exact-refill state machine from the initial round's group admission.

    Usage (the coordinator)::

        plan = plan_refill_rounds(group_admission(...), target_groups=B, quantum=q, max_rounds=R)
        while not plan.done:
            results = generate_gate_and_admit(plan.request.n_groups)  # at the preflight version
            plan = plan.record(results)   # raises RefillExhausted after R failed rounds
        train_on(plan.admitted)

    Args:
        initial_admission: ``{group_id: admitted}`` for the ``target_groups`` initial groups
            (from :func:`replayrl.trainer.rejection.rs_gates.group_admission`), in generation order.
        target_groups: ``rollout_batch_size`` (groups per step).
        quantum: replacement quantum from :func:`refill_quantum`.
        max_rounds: replacement rounds allowed (``>= 0``).

    Returns:
        the plan after the initial round: done, or carrying the first :class:`RefillRequest`.

    Raises:
        RefillConfigError: bad sizes, or an initial round that is not ``target_groups`` groups.
        RefillExhausted: a deficit with ``max_rounds == 0``.
    """
    _positive_int(target_groups, "target_groups")
    _positive_int(quantum, "quantum")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 0:
        raise RefillConfigError(f"max_rounds must be an int >= 0, got {max_rounds!r}")
    if len(initial_admission) != target_groups:
        raise RefillConfigError(
            f"the initial round holds {len(initial_admission)} groups, expected "
            f"target_groups={target_groups}"
        )
    plan = RefillPlan(target_groups=target_groups, quantum=quantum, max_rounds=max_rounds)
    return _fold(plan, initial_admission)
