"""What one trainer rank does with its share of a step: preflight and the update.

:class:`RankStep` holds a rank's backend and its :class:`ProximalLogprobCache` and runs, on the
samples it is given, the preflight forward (proximal logprobs into the cache, replay rates,
support entropies) and the update (per microbatch: forward, PPO/TIS loss, backward; then clip
and optimizer step). The ``trainer`` actor (:class:`replayrl.trainer.ranks.trainer_actor.TrainerActor`) owns
one for rank 0 and makes every decision that needs the whole batch (clock checks, RS gate and
refill, GRPO advantages, the loss denominator, skipping); with ``--dp-size N > 1`` the ranks
``1 .. N-1`` (:class:`replayrl.trainer.ranks.trainer_rank.TrainerRank`) each own one too and run the same
calls on their shares (docs/design/trainer-ranks.md#trainer-ranks).
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from replayrl.actors.heap import HeapKeeper
from replayrl.rollout.sample import Sample, check_required_traces, check_trace_shapes, required_traces
from replayrl.rollout.traces import trace_table
from replayrl.trainer.backends.base import TrainerBackend
from replayrl.trainer.batching.batch import TrainBatch, collate, collate_packed, per_sample_tensors, sampled_masks
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import TrainStepError
from replayrl.trainer.loss.losses import policy_loss
from replayrl.trainer.ranks.proximal_cache import ProximalLogprobCache
from replayrl.trainer.replay.checks import batch_flip_rate, check_replay

__all__ = ["RankStep", "UPDATE_SUMS"]

UPDATE_SUMS = ("abs_logprob_diff", "clipfrac", "clipfrac_low", "clipfrac_high", "tis_weight_mean",
               "surprisal")
"""Token sums one rank's update returns, added over ranks (then divided by the step's token
counts): ``|logp_prox - logp_rollout|`` over sampled tokens, the clip fraction times loss
tokens, the TIS weight mean times sampled tokens, ``-logp_prox`` over sampled tokens."""


class RankStep:
    """One trainer rank's backend, proximal cache and per-share work.

    Args:
        backend: the rank's :class:`TrainerBackend` (already built, in the rank's group).
        config: the trainer settings.

    Attributes:
        cache: this rank's proximal logprobs (only the samples this rank preflighted or was
            given to train).
        entropies: support entropies (float32 [n], sampled tokens) of every forward at the
            step's starting weights since :meth:`take_entropies`.
    """

    def __init__(self, backend: TrainerBackend, config: TrainerConfig) -> None:
        self.backend, self.config = backend, config
        self.cache = ProximalLogprobCache(config.rs_refill_max_candidate_cache_bytes, backend.device)
        self.gate = config.rs_gate
        self.entropies: list[torch.Tensor] = []
        # update() calls so far (one per trainer version; a resumed rank starts at the restored
        # version): every --indexer-drift-interval-th computes drift
        self.updates = 0
        self.heap = HeapKeeper()
        self.required_traces = required_traces(
            backend.model_config, **{f"{row.replay}_replay": getattr(config, row.setting)
                                     for row in trace_table.TRACES})

    def take_entropies(self) -> torch.Tensor:
        """The entropies collected so far, concatenated (float32 [n]); clears them."""
        out = torch.cat(self.entropies) if self.entropies else torch.empty(0)
        self.entropies = []
        return out

    def batches(self, samples: list[Sample]) -> Iterator[tuple[list[Sample], TrainBatch]]:
        """``(chunk, TrainBatch)`` per microbatch of ``--micro-batch-size`` samples.

        Raises:
            replayrl.rollout.errors.MissingTraceError: a sample lacks a trace an enabled replay needs.
            replayrl.rollout.errors.TraceShapeError: a trace has another per-token shape than
                the model's (more or fewer layer columns, another top-k).
        """
        # every forward (preflight, refill, training) refuses a sample lacking a replayed trace
        # before any work: the model's own routing in its place would train the wrong policy
        # and the missing replay would show as no flips
        check_required_traces(samples, self.required_traces)
        # and a trace of another shape than the model's, naming the sample (the model's own
        # shape checks could name neither it nor, replay off, the field)
        check_trace_shapes(samples, self.backend.model_config)
        cfg, mbs = self.config, self.config.micro_batch_size
        for i in range(0, len(samples), mbs):
            chunk = samples[i:i + mbs]
            # traces with flip rates travel whenever captured (the flip metrics compare against
            # them; the forward replays only the enabled ones), the others when replayed
            build = collate_packed if cfg.use_packing else collate
            yield chunk, build(chunk, **{
                row.replay: (getattr(chunk[0], row.name) is not None if row.flip_rates
                             else getattr(cfg, row.setting))
                for row in trace_table.TRACES})

    def preflight(self, samples: list[Sample]) -> dict[str, list[float]]:
        """Proximal logprobs of ``samples`` at the current weights into :attr:`cache`; the
        replay rates per microbatch (as ``TrainerActor.preflight``, which documents them).

        Raises:
            as ``TrainerActor.preflight``.
        """
        rates: dict[str, list[float]] = {}
        for chunk, batch in self.batches(samples):
            out = self.backend.preflight_logprobs(batch)
            for s, part in zip(chunk, torch.split(out.logprobs, [len(s.response_ids) for s in chunk])):
                self.cache.put(s.sample_id, part)
            self.replay_rates(rates, batch, out)
        return rates

    def replay_rates(self, rates: dict[str, list[float]], batch, out) -> None:
        """Append one microbatch's flip / drift rates (and run the replay check) to ``rates``,
        and its support entropies over sampled tokens to :attr:`entropies`."""
        if getattr(out, "support_entropy", None) is not None:
            self.entropies.append(out.support_entropy[batch.sampled_mask > 0])
        for row in trace_table.TRACES:
            if not row.flip_rates:
                continue
            name, engine = row.replay, getattr(batch, row.batch_field)
            used, own = getattr(out, row.name), getattr(out, f"own_{row.name}")
            if engine is None:
                continue
            if own is not None:  # None: skipped this update (--indexer-drift-interval)
                self._check_replay(name, engine, own, batch.key_padding_mask)
            rates.setdefault(f"{name}_flip_rate", []).append(batch_flip_rate(engine, used, batch.key_padding_mask))
            # NaN: undefined this microbatch, logged null (replayrl.trainer.replay.checks.mean_rates)
            rates.setdefault(f"{name}_drift_rate", []).append(
                float("nan") if own is None else batch_flip_rate(engine, own, batch.key_padding_mask))

    def _check_replay(self, kind: str, engine: torch.Tensor, own: torch.Tensor,
                      real: torch.Tensor) -> None:
        min_overlap, max_mismatch = self.config.replay_bounds(kind)  # each kind its own bounds
        if min_overlap == 0 and max_mismatch == 1:
            return
        layers = getattr(self.backend.model_config,
                         next(row.layers for row in trace_table.TRACES if row.replay == kind))
        check_replay(engine.reshape(-1, *engine.shape[2:]), own.reshape(-1, *own.shape[2:]),
                     real.reshape(-1), min_overlap, max_mismatch, layer_ids=layers, kind=kind)

    def update(self, samples: list[Sample], advantages: torch.Tensor,
               token_accept: dict[int, torch.Tensor], loss_accept: dict[int, torch.Tensor],
               denominator: float, *, fused: bool, grad_scale: float = 1.0,
               entropy_coef: float | None = None) -> dict:
        """This rank's share of the update: per microbatch the backend's
        ``forward_backward`` with this step's PPO/TIS loss; then clip and optimizer step
        (collectives of the backend: every rank of the group calls this once per step, with
        the same number of microbatches). The metrics come from the detached logprobs every
        rank receives (under pipeline parallelism the loss itself runs on the last stage).

        Args:
            samples: this rank's share, in the step's order.
            advantages: float32 [len(samples)], one GRPO advantage per sample.
            token_accept: the RS gate's bool [R] token mask per sample id.
            loss_accept: the masks the loss uses (the gate's, minus groups without a baseline).
            denominator: the whole step's loss denominator (tokens over every rank).
            fused: no preflight ran; the proximal logprobs are this forward's, detached; else
                they are taken from :attr:`cache` (which must hold exactly ``samples``).
            grad_scale: the loss is multiplied by it before backward; the data-parallel size
                when the backend averages gradients over ranks (DDP, megatron), so that the
                average is the gradient of the whole step's loss.
            entropy_coef: this step's entropy bonus ``beta`` (the leader's
                :class:`replayrl.trainer.loss.entropy_control.EntropyControl`, the same on every
                rank); None: the configured ``entropy_coef``.
        Returns:
            the :data:`UPDATE_SUMS` token sums, ``max_prox_drift``, ``rates`` (flip / drift
            rates per microbatch, fused only), ``forward_seconds``, ``backward_seconds``,
            ``optimizer_seconds`` and ``grad_norm`` (not finite: nothing was applied);
            forward / backward split at the loss (a pipeline stage without the loss counts its
            whole pass as forward).
        Raises:
            TrainStepError: the training forward does not reproduce the preflight (nothing
                applied on this rank).
        """
        with self.heap.watch():  # a large step keeps its freed blocks for the next (actors/heap.py)
            return self._update(samples, advantages, token_accept, loss_accept, denominator,
                                fused=fused, grad_scale=grad_scale, entropy_coef=entropy_coef)

    def _update(self, samples: list[Sample], advantages: torch.Tensor,
                token_accept: dict[int, torch.Tensor], loss_accept: dict[int, torch.Tensor],
                denominator: float, *, fused: bool, grad_scale: float = 1.0,
                entropy_coef: float | None = None) -> dict:
        """:meth:`update`'s body."""
        cfg = self.config
        beta = cfg.entropy_coef if entropy_coef is None else entropy_coef
        if not fused:
            self.cache.check_bijection([s.sample_id for s in samples])
        self.backend.zero_grad()
        sums = dict.fromkeys(UPDATE_SUMS, 0.0)
        sums["max_prox_drift"] = 0.0
        offset, rates, seconds = 0, {}, {"forward": 0.0, "backward": 0.0}
        backward_threads = cfg.backward_switch_threads
        self.backend.set_own_indexer(self.updates % cfg.indexer_drift_interval == 0)
        self.updates += 1
        for chunk, batch in self.batches(samples):
            t0 = time.perf_counter()
            cached = None if fused else torch.cat(self.cache.take([s.sample_id for s in chunk]))
            accept = torch.cat([token_accept[s.sample_id] for s in chunk])
            trained = torch.cat([loss_accept[s.sample_id] for s in chunk])
            counts = torch.tensor([len(s.response_ids) for s in chunk])
            adv_tok = torch.repeat_interleave(advantages[offset:offset + len(chunk)], counts)
            offset += len(chunk)
            mb_loss = lambda logp, prox: policy_loss(
                logp, prox, batch.rollout_logprobs, adv_tok, batch.loss_mask, eps_low=cfg.eps_clip,
                eps_high=cfg.eps_clip_high, tis_cap=cfg.tis_cap, token_accept=trained,
                sampled_mask=batch.sampled_mask, denominator=cfg.rs_denominator,
                entropy_coef=beta)
            seen: dict = {}

            def loss_fn(logp: torch.Tensor) -> torch.Tensor:
                # runs where the loss lives (the last pipeline stage), between the forward and
                # the backward; fused: the proximal logprobs are this forward's, detached
                seen["t"] = time.perf_counter()
                loss, seen["m"] = mb_loss(logp, logp.detach() if cached is None else cached)
                # policy_loss averages over this microbatch's denominator; rescale to the step's
                mb_den = float(seen["m"]["loss_tokens"] if cfg.rs_denominator == "loss_tokens"
                               else seen["m"]["accepted_tokens"])
                if backward_threads:  # the backward follows (--trainer-backward-threads)
                    torch.set_num_threads(backward_threads)
                return loss * (mb_den * grad_scale / denominator)

            try:
                out = self.backend.forward_backward(batch, loss_fn, capture=fused)
            finally:
                if backward_threads:
                    torch.set_num_threads(cfg.torch_threads)
            t2 = time.perf_counter()
            logp = out.logprobs  # detached, on every rank
            prox = logp if cached is None else cached
            if fused:
                self.replay_rates(rates, batch, out)
            # The same gate, re-applied to this forward, must reproduce the preflight decision:
            # the weights have not moved yet, so logp equals the proximal logprobs up to rounding.
            drift = float((logp - prox).abs().max()) if len(prox) else 0.0
            sums["max_prox_drift"] = max(sums["max_prox_drift"], drift)
            recheck = [accept] if fused else self.gate.decide(
                list(torch.split(logp, [len(s.response_ids) for s in chunk])),
                per_sample_tensors(chunk, "rollout_logprobs"), sampled_masks(chunk))[1]
            if not fused and (drift > 1e-3 or not torch.equal(torch.cat(recheck), accept)):
                # the optimizer step is not reached; the next step's zero_grad drops the gradients
                raise TrainStepError(f"training forward does not reproduce the preflight (max "
                                     f"|logp - logp_prox| = {drift:.2e}); refusing the step")
            m = seen["m"] if "m" in seen else mb_loss(logp, prox)[1]  # a stage without the loss
            t1 = seen.get("t", t2)
            seconds["forward"] += t1 - t0
            seconds["backward"] += t2 - t1
            mask = batch.loss_mask > 0
            # behaviour logprobs exist only where the engine sampled (not at a synthetic EOS)
            sampled = batch.sampled_mask > 0
            sums["abs_logprob_diff"] += float((prox - batch.rollout_logprobs)[sampled].abs().sum())
            sums["clipfrac"] += m["clip_fraction"] * float(mask.sum())
            sums["clipfrac_low"] += m["clip_fraction_low"] * float(mask.sum())
            sums["clipfrac_high"] += m["clip_fraction_high"] * float(mask.sum())
            sums["tis_weight_mean"] += m["tis_weight_mean"] * float(sampled.sum())
            sums["surprisal"] -= float(prox[sampled].sum())
        t0 = time.perf_counter()
        grad_norm = self.backend.clip_and_step(cfg.clip_grad)
        return {**sums, "rates": rates, "forward_seconds": seconds["forward"],
                "backward_seconds": seconds["backward"],
                "optimizer_seconds": time.perf_counter() - t0, "grad_norm": grad_norm}
