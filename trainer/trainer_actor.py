"""The TrainerActor: preflight, GRPO + decoupled PPO/TIS update, weight push.

One call of :meth:`TrainerActor.train` is one optimizer step on one rollout batch:

1. take the batch from the RolloutManager (trajectories cross the wire once);
2. ask the VersionClock to admit every sample (``0 <= t - v <= max_staleness``);
3. preflight forward at the current weights -> proximal logprobs, kept in the (pinned when
   possible) :class:`ProximalLogprobCache`;
4. GRPO advantages, then the loss forward/backward per microbatch with the same replays, the
   decoupled PPO clipped loss with TIS, averaged over all loss tokens of the step;
5. clip, optimizer step, ``trainer_version += 1`` recorded by the clock.

:meth:`push_weights` sends the full weight set to every engine over the transport and records
each engine's new version with the clock. The loop that orders these calls lives in
``tools/train_loop.py`` (slime's ``train_async.py`` shape).
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace

import numpy as np
import torch

from actors import Actor
from rollout.model.checkpoint import load_pretrained, state_dict_arrays
from rollout.sample import Sample
from trainer.advantages import grpo_advantages
from trainer.batch import collate
from trainer.config import TrainerConfig
from trainer.forward import response_logprobs
from trainer.losses import policy_loss
from trainer.proximal_cache import ProximalLogprobCache


class TrainStepError(RuntimeError):
    """A step could not run; raised before the optimizer step, weights untouched."""


class TrainerActor(Actor):
    """Actor that owns the fp32 policy, its optimizer and the proximal-logprob cache.

    Args:
        checkpoint_dir: Hugging Face checkpoint directory of the initial policy.
        config: :meth:`TrainerConfig.to_dict` output.
        n_samples_per_prompt: group size for GRPO.
        engines: engine actor names to push weights to.
        manager: RolloutManager actor name; clock: VersionClock actor name.
    """

    def __init__(self, checkpoint_dir: str, config: dict, n_samples_per_prompt: int,
                 engines: list[str], manager: str = "rollout_manager",
                 clock: str = "version_clock") -> None:
        self.config = TrainerConfig(**config)
        torch.set_num_threads(self.config.torch_threads)
        torch.manual_seed(self.config.seed)
        self.model, self.model_config = load_pretrained(checkpoint_dir, dtype=torch.float32)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=self.config.lr, betas=(self.config.adam_beta1, self.config.adam_beta2),
            weight_decay=self.config.weight_decay)
        self.n = n_samples_per_prompt
        self.engines, self.manager_name, self.clock_name = list(engines), manager, clock
        self.version = 0
        self.cache = ProximalLogprobCache()

    async def push_weights(self) -> dict:
        """Send the current weights (version = optimizer steps applied) to every engine.

        Returns:
            ``{"version", "bytes", "seconds"}``.
        """
        start = time.perf_counter()
        arrays = state_dict_arrays(self.model)
        timeout = self.config.rpc_timeout_s
        await asyncio.gather(*(self.ref(e).call("load_weights", self.version, arrays, timeout=timeout)
                               for e in self.engines))
        clock = self.ref(self.clock_name)
        for e in self.engines:
            await clock.call("record_engine_load", e, self.version, timeout=timeout)
        return {"version": self.version, "bytes": int(sum(a.nbytes for a in arrays.values())),
                "seconds": time.perf_counter() - start}

    def _microbatches(self, samples: list[Sample]):
        cfg, mbs = self.config, self.config.micro_batch_size
        for i in range(0, len(samples), mbs):
            chunk = samples[i:i + mbs]
            yield chunk, collate(chunk, routing=cfg.use_routing_replay,
                                 indexer=cfg.use_indexer_replay, support=cfg.use_support_replay)

    async def train(self, rollout_id: int) -> dict:
        """One optimizer step on rollout ``rollout_id``; returns float metrics.

        Raises:
            actors.RemoteError: the clock rejected a stale sample, or the manager has no batch.
            rollout.sample.SampleError: a malformed trajectory (named).
            TrainStepError: no loss-bearing token in the batch (nothing is applied).
        """
        cfg, timeout = self.config, self.config.rpc_timeout_s
        start = time.perf_counter()
        raw = await self.ref(self.manager_name).call("take_batch", rollout_id, timeout=timeout)
        samples = [Sample.from_dict(d) for d in raw]
        trainer_version = await self.ref(self.clock_name).call(
            "check_samples", [s.sample_id for s in samples], [s.policy_version for s in samples],
            timeout=timeout)
        if trainer_version != self.version:
            raise TrainStepError(f"clock says trainer version {trainer_version}, trainer holds "
                                 f"{self.version}")
        try:
            metrics = self._step(samples)
        finally:
            self.cache.clear()  # nothing survives a step, on success or error
        self.version += 1
        await self.ref(self.clock_name).call("set_trainer_version", self.version, timeout=timeout)
        metrics.update(rollout_id=rollout_id, trainer_version=self.version,
                       staleness_mean=float(np.mean([trainer_version - s.policy_version for s in samples])),
                       staleness_max=int(max(trainer_version - s.policy_version for s in samples)),
                       train_seconds=time.perf_counter() - start)
        return metrics

    def _step(self, samples: list[Sample]) -> dict:
        cfg = self.config
        loss_tokens = float(sum(int(s.loss_mask.sum()) for s in samples))
        if loss_tokens == 0:
            raise TrainStepError("batch has no loss-bearing token; refusing an empty step")
        # 1) preflight: proximal logprobs at the weights this step starts from
        t0 = time.perf_counter()
        with torch.no_grad():
            for chunk, batch in self._microbatches(samples):
                logp, _ = response_logprobs(self.model, batch, cfg.temperature)
                for s, part in zip(chunk, torch.split(logp, [len(s.response_ids) for s in chunk])):
                    self.cache.put(s.sample_id, part)
        preflight_seconds = time.perf_counter() - t0
        cache_peak = self.cache.peak_bytes
        # 2) advantages (GRPO: reward minus group mean), one per sample, broadcast to its tokens
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        adv = grpo_advantages(rewards, self.n, normalize_std=cfg.normalize_advantage_std)
        # 3) loss forward/backward, averaged over every loss token of the step
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"abs_logprob_diff": 0.0, "clipfrac": 0.0, "tis_weight_mean": 0.0}
        offset = 0
        for chunk, batch in self._microbatches(samples):
            logp, _ = response_logprobs(self.model, batch, cfg.temperature)
            prox = torch.cat(self.cache.take([s.sample_id for s in chunk]))
            adv_tok = torch.repeat_interleave(adv[offset:offset + len(chunk)],
                                              torch.tensor([len(s.response_ids) for s in chunk]))
            offset += len(chunk)
            loss, m = policy_loss(logp, prox, batch.rollout_logprobs, adv_tok, batch.loss_mask,
                                  eps_low=cfg.eps_clip, eps_high=cfg.eps_clip_high,
                                  tis_cap=cfg.tis_cap, denominator="loss_tokens")
            weight = float(batch.loss_mask.sum()) / loss_tokens
            (loss * weight).backward()
            mask = batch.loss_mask > 0
            sums["abs_logprob_diff"] += float((prox - batch.rollout_logprobs)[mask].abs().sum())
            sums["clipfrac"] += m.get("clip_fraction", 0.0) * float(mask.sum())
            sums["tis_weight_mean"] += m.get("tis_weight_mean", 1.0) * float(mask.sum())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], cfg.clip_grad))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainStepError(f"non-finite gradient norm {grad_norm}; step skipped, weights untouched")
        self.optimizer.step()
        return {"loss_tokens": loss_tokens, "grad_norm": grad_norm,
                "train_rollout_logprob_abs_diff": sums["abs_logprob_diff"] / loss_tokens,
                "clipfrac": sums["clipfrac"] / loss_tokens,
                "tis_weight_mean": sums["tis_weight_mean"] / loss_tokens,
                "preflight_seconds": preflight_seconds, "proximal_cache_peak_bytes": cache_peak,
                "proximal_cache_pinned": self.cache.pinned}

    async def state(self) -> dict:
        """Trainer version and parameter count (for the REPL and checks)."""
        return {"version": self.version,
                "parameters": int(sum(p.numel() for p in self.model.parameters()))}
