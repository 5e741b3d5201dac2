"""The TrainerActor: preflight, RS gate / exact refill, GRPO + decoupled PPO/TIS update, weight push.

One call of :meth:`TrainerActor.train` is one optimizer step on one rollout batch:

1. take the batch from the RolloutManager (trajectories cross the wire once);
2. ask the VersionClock to admit every sample (``0 <= t - v <= max_staleness``);
3. preflight forward at the weights the step starts from -> proximal logprobs in the
   (pinned when possible) :class:`ProximalLogprobCache`, and the replay flip / drift rates;
4. RS gate (:class:`trainer.rejection.rs_policy.RSGate`); with exact refill, whole prompt
   groups are admitted or dropped and replacements are generated at exactly the preflight
   version until ``rollout_batch_size`` groups are admitted or ``--rs-refill-max-rounds`` is
   spent, in which case the step raises before the optimizer is touched
   (:class:`trainer.rejection.refill.RefillCoordinator`, which gets the cache, the preflight and
   the actor refs, not this actor);
5. GRPO advantages over the trained groups, loss forward/backward per microbatch with the same
   replays and the same gate re-applied, clip, optimizer step, ``trainer_version += 1``.

Everything that touches the weights or the optimizer (forwards, backward, clip + step, weight
export, checkpoints) goes through the backend chosen by ``--train-backend``
(:class:`trainer.backends.base.TrainerBackend`); this actor only orchestrates.
:meth:`push_weights` sends the backend's full weight set to every engine over the transport
and records each engine's new version with the clock. The loop that orders these calls lives in
``tools/train_loop.py`` (slime's ``train_async.py`` shape).
"""
from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import numpy as np
import torch

from actors import Actor
from rollout.sample import Sample
from trainer.advantages import grpo_advantages
from trainer.backends import resolve_backend
from trainer.backends.base import TrainerBackend
from trainer.batch import collate, collate_packed, per_sample_tensors, token_counts
from trainer.config import TrainerConfig
from trainer.losses import policy_loss
from trainer.proximal_cache import ProximalLogprobCache
from trainer.rejection.refill import RefillCoordinator
from trainer.replay import batch_flip_rate, check_replay, mean_rates


class TrainStepError(RuntimeError):
    """A step could not run; raised before the optimizer step, weights untouched."""


class TrainerActor(Actor):
    """Actor that orchestrates the steps; the policy and its optimizer live in its backend.

    The backend (``--train-backend``, :mod:`trainer.backends`) owns the weights and runs the
    forwards, backward, clip + optimizer step, weight export and checkpoints; this actor owns
    the proximal-logprob cache, the RS gate and everything between the actors.

    Args:
        checkpoint_dir: Hugging Face checkpoint directory of the initial policy.
        config: :meth:`TrainerConfig.to_dict` output.
        n_samples_per_prompt: group size for GRPO.
        engines: engine actor names to push weights to.
        rollout_batch_size: prompt groups per step (the exact-refill target).
        vocab_tokens: the tokenizer vocabulary written with checkpoints.
        manager: RolloutManager actor name; clock: VersionClock actor name.

    Raises:
        trainer.config.TrainerConfigError: a bad setting (e.g. an unknown ``--train-backend``).
        rollout.model.CheckpointError: an unreadable ``checkpoint_dir``.
    """

    def __init__(self, checkpoint_dir: str, config: dict, n_samples_per_prompt: int,
                 engines: list[str], rollout_batch_size: int, vocab_tokens: list[str],
                 manager: str = "rollout_manager", clock: str = "version_clock") -> None:
        self.config = TrainerConfig(**config)
        self.backend = resolve_backend(self.config.train_backend)(checkpoint_dir, self.config,
                                                                  vocab_tokens)
        self.n = n_samples_per_prompt
        self.rollout_batch_size = rollout_batch_size
        self.engines, self.manager_name, self.clock_name = list(engines), manager, clock
        self.version = 0
        self.cache = ProximalLogprobCache(self.config.rs_refill_max_candidate_cache_bytes)
        self.gate = self.config.rs_gate

    # -- weights -----------------------------------------------------------------------------
    async def push_weights(self) -> dict:
        """Send the current weights (version = optimizer steps applied) to every engine.

        Returns:
            ``{"version", "bytes", "seconds"}``.
        """
        start = time.perf_counter()
        arrays = self.backend.weights()
        timeout = self.config.rpc_timeout_s
        await asyncio.gather(*(self.proxy(e, timeout).load_weights(self.version, arrays)
                               for e in self.engines))
        clock = self.proxy(self.clock_name, timeout)
        for e in self.engines:
            await clock.record_engine_load(e, self.version)
        return {"version": self.version, "bytes": int(sum(a.nbytes for a in arrays.values())),
                "seconds": time.perf_counter() - start}

    # -- one step ----------------------------------------------------------------------------
    def _batches(self, samples: list[Sample]):
        cfg, mbs = self.config, self.config.micro_batch_size
        for i in range(0, len(samples), mbs):
            chunk = samples[i:i + mbs]
            # traces travel whenever captured (the flip metrics compare against them); the
            # forward replays only the enabled ones
            build = collate_packed if cfg.use_packing else collate
            yield chunk, build(chunk, routing=chunk[0].routed_experts is not None,
                               indexer=chunk[0].indexer_topk is not None,
                               support=cfg.use_support_replay)

    def preflight(self, samples: list[Sample]) -> dict[str, list[float]]:
        """Proximal logprobs of ``samples`` at the current weights into the cache.

        Returns the replay rates, one value per microbatch (NaN when it has no captured real
        row; :func:`trainer.replay.mean_rates` makes the step metrics): ``*_flip_rate`` =
        fraction of captured rows where the trainer used other experts / keys than the engine
        (0 when the replay works), ``*_drift_rate`` = where the trainer's own router / indexer
        would have chosen differently (numerics plus policy change since the sample was
        generated). Keys ``routing_*`` / ``indexer_*`` appear only when the samples carry that
        trace.

        Raises:
            trainer.replay.ReplayMismatch: the engine's and the trainer's own choices disagree
                beyond ``--replay-min-overlap-ratio`` / ``--replay-max-mismatch-fraction``.
            trainer.proximal_cache.ProximalCacheError: the cache's byte cap is exceeded.
        """
        rates: dict[str, list[float]] = {}
        for chunk, batch in self._batches(samples):
            out = self.backend.preflight_logprobs(batch)
            for s, part in zip(chunk, torch.split(out.logprobs, [len(s.response_ids) for s in chunk])):
                self.cache.put(s.sample_id, part)
            self._replay_rates(rates, batch, out)
        return rates

    def _replay_rates(self, rates: dict[str, list[float]], batch, out) -> None:
        """Append one microbatch's flip / drift rates (and run the replay check) to ``rates``."""
        for name, engine, used, own in (
                ("routing", batch.routed_experts, out.routed_experts, out.own_routed_experts),
                ("indexer", batch.indexer_topk, out.indexer_topk, out.own_indexer_topk)):
            if engine is not None:
                self._check_replay(name, engine, own, batch.key_padding_mask)
                rates.setdefault(f"{name}_flip_rate", []).append(batch_flip_rate(engine, used, batch.key_padding_mask))
                rates.setdefault(f"{name}_drift_rate", []).append(batch_flip_rate(engine, own, batch.key_padding_mask))

    def needs_preflight(self) -> bool:
        """Whether a step runs the separate preflight forward before its update.

        Only an RS gate (and with it exact refill) or the replay check
        (``--replay-min-overlap-ratio`` / ``--replay-max-mismatch-fraction``) need the
        proximal logprobs or the choices before the update. Otherwise, with one optimizer step
        per rollout, the proximal logprobs ARE the detached logprobs of the training forward at
        the same weights, and the flip / drift rates come from that forward: one forward per
        microbatch instead of two (``--preflight always`` keeps the separate one).
        """
        cfg = self.config
        return (cfg.preflight == "always" or self.gate.active
                or cfg.replay_min_overlap_ratio != 0 or cfg.replay_max_mismatch_fraction != 1
                or type(self.backend).train_forward is TrainerBackend.train_forward)

    def _check_replay(self, kind: str, engine: torch.Tensor, own: torch.Tensor,
                      real: torch.Tensor) -> None:
        cfg = self.config
        if cfg.replay_min_overlap_ratio == 0 and cfg.replay_max_mismatch_fraction == 1:
            return
        model_config = self.backend.model_config
        layers = model_config.moe_layers if kind == "routing" else model_config.indexed_layers
        check_replay(engine.reshape(-1, *engine.shape[2:]), own.reshape(-1, *own.shape[2:]),
                     real.reshape(-1), cfg.replay_min_overlap_ratio, cfg.replay_max_mismatch_fraction,
                     layer_ids=layers, kind=kind)

    async def train(self, rollout_id: int) -> dict:
        """One optimizer step on rollout ``rollout_id``; returns float metrics.

        Raises:
            actors.RemoteError: the clock rejected a stale sample, or the manager has no batch.
            rollout.sample.SampleError: a malformed trajectory (named).
            trainer.rejection.refill_planner.RefillExhausted: too few admitted groups (nothing applied).
            TrainStepError: no loss-bearing token, a non-finite gradient, or a training forward
                that does not reproduce the preflight gate (nothing applied).
        """
        cfg = self.config
        clock = self.proxy(self.clock_name, cfg.rpc_timeout_s)
        start = time.perf_counter()
        raw = await self.proxy(self.manager_name, cfg.rpc_timeout_s).take_batch(rollout_id)
        samples = [Sample.from_dict(d) for d in raw]
        transport_seconds = time.perf_counter() - start  # the batch's RPC, decode and checks
        trainer_version = await clock.check_samples([s.sample_id for s in samples],
                                                    [s.policy_version for s in samples])
        if trainer_version != self.version:
            raise TrainStepError(f"clock says trainer version {trainer_version}, trainer holds "
                                 f"{self.version}")
        self.cache.reset_counters()
        try:
            if self.needs_preflight():
                t0 = time.perf_counter()
                metrics = mean_rates(self.preflight(samples))
                metrics["preflight_seconds"] = time.perf_counter() - t0
                coordinator = RefillCoordinator(
                    self.gate, self.config, self.rollout_batch_size, self.n, cache=self.cache,
                    preflight=self.preflight,
                    manager=self.proxy(self.manager_name, cfg.rs_refill_rpc_timeout_s),
                    clock=clock.with_timeout(cfg.rs_refill_rpc_timeout_s), version=self.version)
                admitted, token_accept, refill_metrics = await coordinator.admit(samples)
                metrics.update(refill_metrics)
                metrics.update(self._update(admitted, token_accept))
            else:  # no gate: every token accepted, as RSGate("none") decides
                admitted, token_accept = samples, {s.sample_id: torch.ones(len(s.response_ids), dtype=torch.bool)
                                                   for s in samples}
                loss_count, accepted_count = token_counts(samples, token_accept)
                metrics = {"preflight_seconds": 0.0, "generated_samples": len(samples),
                           "rs_sample_accept_rate": 1.0,
                           "rs_token_accept_rate": accepted_count / max(loss_count, 1)}
                metrics.update(self._update(admitted, token_accept, fused=True))
        finally:
            self.cache.clear()  # nothing survives a step, on success or error
        self.version += 1
        await clock.set_trainer_version(self.version)
        seconds = time.perf_counter() - start
        metrics.update(rollout_id=rollout_id, trainer_version=self.version,
                       staleness_mean=float(np.mean([trainer_version - s.policy_version for s in admitted])),
                       staleness_max=int(max(trainer_version - s.policy_version for s in admitted)),
                       train_seconds=seconds, transport_seconds=transport_seconds,
                       effective_tokens_per_second=metrics["accepted_tokens"] / seconds)
        return metrics

    def _update(self, samples: list[Sample], token_accept: dict[int, torch.Tensor],
                fused: bool = False) -> dict:
        """The loss forward / backward per microbatch and the optimizer step. ``fused``: no
        preflight ran; the proximal logprobs are this forward's, detached (same weights), and
        the replay rates come from it too (:meth:`needs_preflight`)."""
        cfg = self.config
        if not fused:
            self.cache.check_bijection([s.sample_id for s in samples])
        loss_count, accepted_count = token_counts(samples, token_accept)
        loss_tokens, accepted = float(loss_count), float(accepted_count)
        denominator = loss_tokens if cfg.rs_denominator == "loss_tokens" else accepted
        if denominator == 0:
            raise TrainStepError("no loss-bearing (accepted) token in the step; refusing an empty step")
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        adv = grpo_advantages(rewards, self.n, normalize_std=cfg.normalize_advantage_std)
        self.backend.zero_grad()
        sums = {"abs_logprob_diff": 0.0, "clipfrac": 0.0, "tis_weight_mean": 0.0, "max_prox_drift": 0.0}
        offset, rates, seconds = 0, {}, {"forward": 0.0, "backward": 0.0}
        for chunk, batch in self._batches(samples):
            t0 = time.perf_counter()
            if fused:
                out = self.backend.train_forward(batch)
                logp, prox = out.logprobs, out.logprobs.detach()
                self._replay_rates(rates, batch, out)
            else:
                logp = self.backend.train_logprobs(batch)
                prox = torch.cat(self.cache.take([s.sample_id for s in chunk]))
            accept = torch.cat([token_accept[s.sample_id] for s in chunk])
            # The same gate, re-applied to this forward, must reproduce the preflight decision:
            # the weights have not moved yet, so logp equals the proximal logprobs up to rounding.
            drift = float((logp.detach() - prox).abs().max())
            sums["max_prox_drift"] = max(sums["max_prox_drift"], drift)
            recheck = [accept] if fused else self.gate.decide(
                list(torch.split(logp.detach(), [len(s.response_ids) for s in chunk])),
                per_sample_tensors(chunk, "rollout_logprobs"),
                per_sample_tensors(chunk, "loss_mask"))[1]
            if not fused and (drift > 1e-3 or not torch.equal(torch.cat(recheck), accept)):
                raise TrainStepError(f"training forward does not reproduce the preflight (max "
                                     f"|logp - logp_prox| = {drift:.2e}); refusing the step")
            counts = torch.tensor([len(s.response_ids) for s in chunk])
            adv_tok = torch.repeat_interleave(adv[offset:offset + len(chunk)], counts)
            offset += len(chunk)
            loss, m = policy_loss(logp, prox, batch.rollout_logprobs, adv_tok, batch.loss_mask,
                                  eps_low=cfg.eps_clip, eps_high=cfg.eps_clip_high,
                                  tis_cap=cfg.tis_cap, token_accept=accept,
                                  denominator=cfg.rs_denominator)
            # policy_loss averages over this microbatch's denominator; rescale to the step's
            mb_den = float(m["loss_tokens"] if cfg.rs_denominator == "loss_tokens" else m["accepted_tokens"])
            t1 = time.perf_counter()
            self.backend.backward(loss * (mb_den / denominator))
            seconds["forward"] += t1 - t0
            seconds["backward"] += time.perf_counter() - t1
            mask = batch.loss_mask > 0
            sums["abs_logprob_diff"] += float((prox - batch.rollout_logprobs)[mask].abs().sum())
            sums["clipfrac"] += m["clip_fraction"] * float(mask.sum())
            sums["tis_weight_mean"] += m["tis_weight_mean"] * float(mask.sum())
        t0 = time.perf_counter()
        grad_norm = self.backend.clip_and_step(cfg.clip_grad)
        optimizer_seconds = time.perf_counter() - t0
        if not math.isfinite(grad_norm):
            raise TrainStepError(f"non-finite gradient norm {grad_norm}; step skipped, weights untouched")
        return {**mean_rates(rates), "loss_forward_seconds": seconds["forward"],
                "loss_backward_seconds": seconds["backward"], "optimizer_seconds": optimizer_seconds,
                "trained_groups": len(samples) // self.n, "loss_tokens": loss_tokens,
                "accepted_tokens": accepted, "grad_norm": grad_norm,
                "train_rollout_logprob_abs_diff": sums["abs_logprob_diff"] / loss_tokens,
                "clipfrac": sums["clipfrac"] / loss_tokens,
                "tis_weight_mean": sums["tis_weight_mean"] / loss_tokens,
                "max_prox_drift": sums["max_prox_drift"],
                "proximal_cache_peak_bytes": self.cache.peak_bytes,
                "proximal_cache_transferred_bytes": self.cache.transferred_bytes,
                "proximal_cache_pinned": self.cache.pinned}

    # -- checkpoints -------------------------------------------------------------------------
    async def save_checkpoint(self, directory: str) -> str:
        """Write model (HF format), optimizer state, version and RNG state under ``directory``."""
        out = Path(directory)
        self.backend.save_checkpoint(out, self.version)
        return str(out)

    async def load_checkpoint(self, directory: str) -> int:
        """Restore :meth:`save_checkpoint` output; returns the restored trainer version."""
        self.version = self.backend.load_checkpoint(Path(directory))
        return self.version

    async def state(self) -> dict:
        """Trainer version and parameter count (for the REPL and checks)."""
        return {"version": self.version,
                "parameters": self.backend.parameter_count()}

    async def weights_digest(self) -> dict:
        """Per-tensor raw bytes of weights and optimizer moments (bitwise comparisons in tests)."""
        return self.backend.digest()
