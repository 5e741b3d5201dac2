"""Trainer ranks 1 .. N-1 (``trainer_1 ..``): a share of every step, driven by rank 0.

With ``--dp-size N > 1`` (docs/design/trainer-ranks.md#trainer-ranks) the ``trainer`` actor is rank 0:
it takes the batch, talks to the clock, the manager and the engines, and makes every decision
that needs the whole batch (RS gate and refill, advantages, the loss denominator, skipping).
A :class:`TrainerRank` builds the same backend in the same process group and runs, when rank 0
calls it, the same per-share work (:class:`replayrl.trainer.ranks.rank_step.RankStep`) on the share it is
sent; the gradients meet in the backend's data-parallel wrapper (torch DDP, FSDP2, megatron's DDP).
It never calls another actor.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from replayrl.actors import Actor
from replayrl.rollout.sample import samples_from_columns
from replayrl.trainer.backends import resolve_backend
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.ranks.rank_group import RankGroup
from replayrl.trainer.ranks.rank_step import RankStep

__all__ = ["TrainerRank"]


class TrainerRank(Actor):
    """One trainer rank other than 0: its backend, its proximal cache, its share of a step.

    Args:
        checkpoint_dir: the initial policy (as ``TrainerActor``).
        config: :meth:`TrainerConfig.to_dict` output (the run's; the same on every rank).
        vocab_tokens: the tokenizer vocabulary written with checkpoints.
        group: ``{"rank", "size", "host", "port"}`` of :class:`replayrl.trainer.ranks.rank_group.RankGroup`;
            joined before the backend is built (blocks until every rank joined).

    Raises:
        replayrl.trainer.ranks.rank_group.RankGroupError: a bad ``group``.
        as ``TrainerActor`` for the checkpoint and the config.
    """

    def __init__(self, checkpoint_dir: str, config: dict, vocab_tokens: list[str],
                 group: dict) -> None:
        self.config = TrainerConfig(**config)
        RankGroup(timeout_s=self.config.rpc_timeout_s, **group).join()
        self.backend = resolve_backend(self.config.train_backend)(checkpoint_dir, self.config,
                                                                  vocab_tokens)
        self.step = RankStep(self.backend, self.config)

    async def data_parallel(self) -> list[int]:
        """``[dp_rank, dp_size]`` of this rank (its share of every batch)."""
        return list(self.backend.data_parallel())

    async def preflight(self, columns: dict) -> dict:
        """Proximal logprobs of the samples in ``columns`` (``replayrl.rollout.sample.samples_to_columns``)
        at the current weights, for rank 0's cache: ``{"logprobs": float32 [sum R] (samples in
        order), "rates": replay rates per microbatch, "entropy": float32 [n]}``. Nothing stays
        here: rank 0 decides which samples train, and sends their logprobs with them.

        Raises:
            as ``TrainerActor.preflight``.
        """
        samples = samples_from_columns(columns, decode_threads=self.config.trace_decode_threads)
        try:
            rates = self.step.preflight(samples)
            parts = self.step.cache.take([s.sample_id for s in samples])
        finally:
            self.step.cache.clear()
        logprobs = torch.cat(parts).numpy() if parts else np.zeros(0, np.float32)
        return {"logprobs": logprobs, "rates": rates,
                "entropy": self.step.take_entropies().numpy()}

    async def train(self, columns: dict, advantages: np.ndarray, token_accept: np.ndarray,
                    loss_accept: np.ndarray, denominator: float, fused: bool,
                    proximal: np.ndarray | None, grad_scale: float,
                    entropy_coef: float | None = None) -> dict:
        """This rank's share of the update (:meth:`replayrl.trainer.ranks.rank_step.RankStep.update`).

        Args:
            columns: the share's samples (``samples_to_columns``).
            advantages: float32 [B_share]; token_accept, loss_accept: bool [sum R], the masks
                of the samples in order.
            denominator, fused, grad_scale, entropy_coef: as ``RankStep.update``.
            proximal: float32 [sum R], the share's proximal logprobs (None when ``fused``);
                they fill this rank's cache for the update.
        Returns:
            ``RankStep.update``'s result plus ``entropy`` (float32 [n]).
        Raises:
            replayrl.trainer.ranks.rank_step.TrainStepError: as ``RankStep.update``; ValueError: arrays that
                do not match the samples' response lengths.
        """
        samples = samples_from_columns(columns, decode_threads=self.config.trace_decode_threads)
        counts = [len(s.response_ids) for s in samples]
        masks = {}
        for name, value in (("token_accept", token_accept), ("loss_accept", loss_accept),
                            *((("proximal", proximal),) if proximal is not None else ())):
            if len(value) != sum(counts):
                raise ValueError(f"{name} has {len(value)} entries, the share's responses "
                                 f"{sum(counts)} tokens")
            masks[name] = dict(zip([s.sample_id for s in samples],
                                   torch.split(torch.from_numpy(np.array(value)), counts)))
        if len(advantages) != len(samples):
            raise ValueError(f"advantages has {len(advantages)} entries for {len(samples)} samples")
        self.step.cache.reset_counters()
        try:
            if proximal is not None:
                for sample_id, logprobs in masks["proximal"].items():
                    self.step.cache.put(sample_id, logprobs)
            out = self.step.update(samples, torch.from_numpy(np.array(advantages, np.float32)),
                                   masks["token_accept"], masks["loss_accept"], denominator,
                                   fused=fused, grad_scale=grad_scale, entropy_coef=entropy_coef)
        finally:
            self.step.cache.clear()
        return {**out, "entropy": self.step.take_entropies().numpy()}

    async def push_tensors(self, full: bool = True) -> int:
        """Take part in gathering a weight push (``TrainerBackend.push_tensors``: the weights,
        or under LoRA the adapters, after the base weights when ``full``) of a backend whose
        ranks hold parts; rank 0 sends it. Returns the bytes this rank saw."""
        return int(sum(t.numel() * t.element_size()
                       for t in self.backend.push_tensors(bool(full)).values()))

    async def save_checkpoint(self, directory: str, version: int) -> str:
        """This rank's part of ``TrainerActor.save_checkpoint`` (a backend whose ranks hold
        parts)."""
        self.backend.save_checkpoint(Path(directory), version)
        return directory

    async def save_hf(self, directory: str) -> str:
        """This rank's part of ``TrainerActor.save_hf`` (a backend whose ranks hold parts)."""
        self.backend.save_hf(Path(directory))
        return directory

    async def load_checkpoint(self, directory: str, min_version: int) -> int:
        """Restore this rank's state from ``TrainerActor.save_checkpoint`` output; returns
        the saved version.

        Raises:
            as ``TrainerBackend.load_checkpoint``.
        """
        version = self.backend.load_checkpoint(Path(directory), min_version=min_version)
        self.step.updates = version  # as TrainerActor.load_checkpoint: the drift phase continues
        return version

    async def weights_digest(self) -> dict:
        """This rank's weights and optimizer moments as raw bytes (``TrainerBackend.digest``):
        data-parallel replicas hold the same bytes as rank 0."""
        return self.backend.digest()
