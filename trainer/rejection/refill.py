"""The exact-refill coordinator of one optimizer step (docs/design/rejection-sampling.md#exact-refill).

Given a batch whose proximal logprobs are already cached, it applies the RS gate and decides
what the step trains on:

- RS off: everything;
- RS on, refill off: every sample, with rejected tokens masked out of the loss (the loss
  denominator policy is :mod:`replayrl.trainer.rejection.rs_policy`'s; the update takes each group's
  baseline over its accepted samples, docs/design/rejection-sampling.md#rejection-sampling);
- RS on, refill on: whole prompt groups (group-atomic admission). Rejected groups are dropped
  and ``ceil(deficit / q) * q`` replacement groups are requested from the RolloutManager, which
  generates them from the current policy; each replacement's version must equal the preflight
  version exactly (checked by the VersionClock). After ``--rs-refill-max-rounds`` rounds still
  short, :class:`replayrl.trainer.rejection.refill_planner.RefillExhausted` is raised, before any
  optimizer work.

With ``--dynamic-sampling`` (DAPO, :mod:`replayrl.trainer.rejection.dynamic_sampling`) a group
whose rewards are all equal is dropped too and refilled through the same rounds: a group is
admitted iff the gate admits it (with ``--rs-batch-refill``; without an RS gate, always) and its
rewards differ. Without an RS gate no proximal logprobs are needed: the trainer then runs no
preflight (``preflight`` returns no rates) and the update computes them itself.

Only admitted cache entries move on; rejected and surplus entries are discarded at once.
Every cross-actor call here has ``--rs-refill-rpc-timeout-seconds``.

The coordinator is given what it needs (the preflight callable, the proximal cache, the
manager and clock references, the preflight version), not the TrainerActor, so it does not
import the actor. The replacements' replay rates, measured by their preflight, are reported
as ``refill_<name>`` metrics next to the step's own ``<name>`` replay metrics.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import torch

from replayrl.actors import ActorProxy
from replayrl.rollout.sample import Sample, samples_from_columns
from replayrl.trainer.batching.batch import per_sample_tensors, sampled_masks, token_counts
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.ranks.proximal_cache import ProximalLogprobCache
from replayrl.trainer.rejection.dynamic_sampling import combine_admission, informative_groups
from replayrl.trainer.rejection.refill_planner import plan_refill_rounds, refill_quantum
from replayrl.trainer.rejection.rs_gates import group_admission
from replayrl.trainer.rejection.rs_policy import RSGate
from replayrl.trainer.replay.checks import mean_rates

Preflight = Callable[[list[Sample]], Awaitable[dict[str, list[float]]]]
"""Proximal logprobs of the samples into the cache; returns per-microbatch replay rates
(``{"routing_flip_rate": [...], ...}``, as ``TrainerActor.preflight_ranks``, which spreads the
forward over the trainer ranks)."""


def gate_metrics(samples: list[Sample], accept: list[bool],
                 token_accept: dict[int, torch.Tensor]) -> dict:
    """The step metrics of one gate decision over the step's candidate ``samples``.

    Args:
        accept: per-sample decision, in ``samples`` order; token_accept: sample id -> bool [R].
    Returns:
        ``generated_samples``, ``rs_sample_accept_rate`` (fraction of samples accepted) and
        ``rs_token_accept_rate`` (accepted / loss tokens; 0 without loss tokens).
    """
    loss_tokens, accepted_tokens = token_counts(samples, token_accept)
    return {"generated_samples": len(samples), "rs_sample_accept_rate": sum(accept) / len(accept),
            "rs_token_accept_rate": accepted_tokens / max(loss_tokens, 1)}


class RefillCoordinator:
    """Admission and refill rounds of one step, driving a :class:`RefillPlan`.

    Args:
        gate: the run's RS gate; config: trainer settings; target_groups: groups per step;
        n: samples per prompt group.
        cache: the step's proximal-logprob cache (every candidate's entry is already in it).
        preflight: (async) fills the cache for replacement samples and returns their
            replay rates.
        manager, clock: references to the RolloutManager (``generate_replacements``) and the
            VersionClock (``check_replacements``), as typed proxies whose timeout is
            ``--rs-refill-rpc-timeout-seconds``.
        version: the trainer version the preflight ran at (replacements must match it).
    """

    def __init__(self, gate: RSGate, config: TrainerConfig, target_groups: int, n: int, *,
                 cache: ProximalLogprobCache, preflight: Preflight, manager: ActorProxy,
                 clock: ActorProxy, version: int) -> None:
        self.gate, self.config = gate, config
        self.target_groups, self.n = target_groups, n
        self.cache, self.preflight = cache, preflight
        self.manager, self.clock, self.version = manager, clock, version

    def _decide(self, samples: list[Sample]) -> tuple[list[bool], dict[int, torch.Tensor]]:
        if not self.gate.active:  # accepts everything; needs no proximal logprob (none cached)
            return [True] * len(samples), {s.sample_id: torch.ones(len(s.response_ids), dtype=torch.bool)
                                           for s in samples}
        cache = self.cache
        accept, tokens = self.gate.decide(
            [cache.peek(s.sample_id) for s in samples],
            per_sample_tensors(samples, "rollout_logprobs"),
            sampled_masks(samples))  # only sampled tokens have a behaviour logprob (no synthetic EOS)
        return accept, {s.sample_id: t for s, t in zip(samples, tokens)}

    async def admit(self, samples: list[Sample]) -> tuple[list[Sample], dict[int, torch.Tensor], dict]:
        """Return ``(samples to train on, per-sample token accept masks, metrics)``.

        With refill, the metrics include ``refill_<name>`` for every replay rate ``<name>`` the
        replacements' preflight measured (``refill_routing_flip_rate``,
        ``refill_routing_drift_rate``, ``refill_indexer_flip_rate``,
        ``refill_indexer_drift_rate``: the mean over all replacement microbatches of the step,
        as :func:`replayrl.trainer.replay.checks.mean_rates`), only when replacements were generated.
        With ``--dynamic-sampling`` they include ``zero_variance_groups`` (groups of this step,
        initial and replacement, whose rewards were all equal; each is also counted in
        ``rejected_groups``, the groups dropped for any reason), and every
        ``refill_round_detail`` entry its round's ``zero_variance_groups``.

        Raises:
            RefillExhausted: still short of ``target_groups`` after the allowed rounds.
            replayrl.actors.RemoteError / ActorTimeout: a refill call failed or timed out.
        """
        start = time.perf_counter()
        accept, token_accept = self._decide(samples)
        metrics = gate_metrics(samples, accept, token_accept)
        dynamic = self.config.dynamic_sampling
        if not (self.gate.active and self.config.rs_batch_refill) and not dynamic:
            metrics["coordinator_seconds"] = time.perf_counter() - start
            return samples, token_accept, metrics

        cfg = self.config
        by_group: dict[int, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group_id, []).append(s)
        admission, flat = self._admission(samples, accept)
        quantum = refill_quantum(cfg.dp_size, self.n, cfg.vpp_size, cfg.microbatch_group_size)
        rounds = [{"round": 0, "candidate_groups": len(admission),
                   "rejected_groups": sum(not ok for ok in admission.values()), **flat}]
        plan = plan_refill_rounds(admission, target_groups=self.target_groups, quantum=quantum,
                                  max_rounds=cfg.rs_refill_max_rounds)
        replacement_seconds = replacement_preflight = 0.0
        replacement_rates: dict[str, list[float]] = {}
        while not plan.done:
            t0 = time.perf_counter()
            raw = await self.manager.generate_replacements(plan.request.n_groups,
                                                          min_version=self.version)
            replacement_seconds += time.perf_counter() - t0
            repl = samples_from_columns(raw, decode_threads=cfg.trace_decode_threads)
            metrics["generated_samples"] += len(repl)
            await self.clock.check_replacements(self.version, [s.sample_id for s in repl],
                                                [s.policy_version for s in repl])
            t0 = time.perf_counter()
            for name, rates in (await self.preflight(repl)).items():
                replacement_rates.setdefault(name, []).extend(rates)
            replacement_preflight += time.perf_counter() - t0
            r_accept, r_tokens = self._decide(repl)
            token_accept.update(r_tokens)
            for s in repl:
                by_group.setdefault(s.group_id, []).append(s)
            r_admission, flat = self._admission(repl, r_accept)
            before = len(plan.surplus)
            try:
                plan = plan.record(r_admission)
            finally:
                rounds.append({"round": len(rounds), "candidate_groups": len(r_admission),
                               "rejected_groups": sum(not ok for ok in r_admission.values()),
                               **flat})
            rounds[-1]["surplus_groups"] = len(plan.surplus) - before
        admitted = [s for g in plan.admitted for s in by_group[g]]
        keep = {s.sample_id for s in admitted}
        self.cache.discard([s.sample_id for group in by_group.values() for s in group
                               if s.sample_id not in keep])
        metrics.update(refill_rounds=plan.rounds, refill_round_detail=rounds,
                       admitted_groups=len(plan.admitted), rejected_groups=len(plan.rejected),
                       surplus_groups=len(plan.surplus),
                       replacement_generate_seconds=replacement_seconds,
                       replacement_preflight_seconds=replacement_preflight,
                       coordinator_seconds=time.perf_counter() - start)
        metrics.update({f"refill_{k}": v for k, v in mean_rates(replacement_rates).items()})
        if dynamic:
            metrics["zero_variance_groups"] = sum(r["zero_variance_groups"] for r in rounds)
        return admitted, token_accept, metrics

    def _admission(self, samples: list[Sample], accept: list[bool]) -> tuple[dict, dict]:
        """``({group_id: admitted}, round counts)`` of one round's candidates, in order.

        Admitted = the gate admits the whole group (only with an active gate and
        ``--rs-batch-refill``) and, with ``--dynamic-sampling``, its rewards differ. The round
        counts are ``{"zero_variance_groups": k}`` with dynamic sampling (groups whose rewards
        are all equal, whatever the gate said), else empty.
        """
        ids = [s.group_id for s in samples]
        if self.gate.active and self.config.rs_batch_refill:
            admission = group_admission(accept, ids, n_samples_per_prompt=self.n)
        else:  # dynamic sampling alone (refused with a gate but no --rs-batch-refill)
            admission = dict.fromkeys(ids, True)
        if not self.config.dynamic_sampling:
            return admission, {}
        informative = informative_groups([s.reward for s in samples], ids,
                                         n_samples_per_prompt=self.n)
        return (combine_admission(admission, informative),
                {"zero_variance_groups": sum(not ok for ok in informative.values())})
