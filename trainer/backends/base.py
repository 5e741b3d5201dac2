"""The trainer-backend interface: what the TrainerActor asks of the part that owns the model.

One backend instance lives in each trainer rank's process for the whole run (one rank, or
``--dp-size`` x ``--tp-size`` ranks that make the same calls on their shares,
docs/design/trainer-ranks.md#trainer-ranks). Every call is synchronous and runs on the caller's
thread; tensors crossing the interface are CPU torch tensors (a backend on accelerators moves them).
The per-step call order, driven by
:class:`replayrl.trainer.ranks.trainer_actor.TrainerActor`, is::

    preflight_logprobs(mb) for every microbatch (and every refill round)
    zero_grad()
    for every microbatch: forward_backward(mb, loss_fn) (the loss is the actor's)
    clip_and_step(max_norm)

or, when no RS gate, refill or replay check needs the proximal logprobs before the update,
without the preflight: ``zero_grad()``, then ``forward_backward(mb, loss_fn, capture=True)``
(the logprobs, whose detached values are the proximal ones, plus the routing / indexer
choices) per microbatch, then ``clip_and_step``. The default ``forward_backward`` is
``train_logprobs`` / ``train_forward`` -> ``loss_fn`` -> ``backward``.

plus :meth:`TrainerBackend.push_tensors` after a step (the weight push), and checkpoint save /
load, :meth:`TrainerBackend.digest` and :meth:`TrainerBackend.parameter_count` on request.
"""
from __future__ import annotations

import dataclasses
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from replayrl.rollout.model.config import ModelConfig
from replayrl.trainer.batching.batch import TrainBatch

__all__ = ["ReplayedForward", "TrainerBackend"]


@dataclass(frozen=True)
class ReplayedForward:
    """Output of a preflight forward: proximal logprobs and the discrete choices it made.

    Attributes:
        logprobs: float32 [N] (nats), one per response token of the microbatch, samples in
            batch order, detached.
        routed_experts, own_routed_experts: int [B, S, L_moe, K_router] experts the forward
            used (the replayed trace where it replays) and the ones its routers would have
            chosen themselves; None for a model without MoE layers.
        indexer_topk, own_indexer_topk: int [B, S, L_idx, K_index] keys used / own choice
            (``-1`` = empty slot); None for a model without an indexer.
        support_entropy: float32 [N] (nats, detached), the policy's entropy over each response
            token's sampled support (:func:`replayrl.trainer.loss.logprobs.support_entropy`; observation
            rows 0); None where the backend does not compute it (e.g. the fused LM head path).

    ``B, S`` are the microbatch's rows and positions (one packed row with ``--use-packing``),
    the same axes as the :class:`replayrl.trainer.batching.batch.TrainBatch` traces they are compared with.
    """

    logprobs: torch.Tensor
    routed_experts: torch.Tensor | None
    own_routed_experts: torch.Tensor | None
    indexer_topk: torch.Tensor | None
    own_indexer_topk: torch.Tensor | None
    support_entropy: torch.Tensor | None = None


class TrainerBackend(ABC):
    """Owns the policy weights and the optimizer; runs the replayed forwards and the update.

    A subclass is constructed as ``Backend(checkpoint_dir, config, vocab_tokens)``: load the
    Hugging Face checkpoint directory ``checkpoint_dir`` (the initial policy), build the
    optimizer from ``config`` (a :class:`replayrl.trainer.config.TrainerConfig`: lr, betas, weight decay,
    seed, replay switches, temperature, logprob chunk size) and keep ``vocab_tokens`` (the
    tokenizer vocabulary written with checkpoints). Register it in
    :data:`replayrl.trainer.backends.BACKENDS`.

    Both forwards compute the logprob of every response token of a
    :class:`replayrl.trainer.batching.batch.TrainBatch` at temperature ``config.temperature`` (logits / T),
    replaying the batch's routing / indexer traces when present and enabled
    (``use_routing_replay`` / ``use_indexer_replay``) and normalising over the captured support
    when the batch has one (support replay), so that ``logp_prox - logp_rollout`` measures only
    numerics (docs/design/trainer-math.md#trainer-math).
    """

    device: torch.device = torch.device("cpu")
    """Where the policy computes (the torch and fsdp backends: this rank's ``--device``); the
    tensors crossing the interface stay on the CPU either way."""

    collective_io: bool = False
    """Whether :meth:`weights`, :meth:`save_checkpoint` and :meth:`save_hf` are collectives
    that every trainer rank calls (a model split over ranks); otherwise every rank holds the
    whole model and rank 0 alone calls them (docs/design/trainer-ranks.md#trainer-ranks)."""

    collective_forward: bool = False
    """Whether every forward (the preflight's too) is a collective of the data-parallel ranks
    (weights sharded over them, FSDP): then a preflight is split over the ranks exactly, like
    an update, so that every rank runs the same number of microbatches; otherwise a preflight
    share may be one sample longer than another (docs/design/trainer-ranks.md#trainer-ranks)."""

    def data_parallel(self) -> tuple[int, int]:
        """``(dp_rank, dp_size)``: this rank's place among the data-parallel ranks, which
        train contiguous, equal shares of each batch. ``(0, 1)`` when the process is in no
        process group; otherwise its rank and size in the default group (every rank a
        data-parallel replica). A backend with model parallelism overrides it."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(), dist.get_world_size()

    @property
    @abstractmethod
    def model_config(self) -> ModelConfig:
        """The policy's architecture (``moe_layers`` / ``indexed_layers`` name trace columns)."""

    @abstractmethod
    def preflight_logprobs(self, batch: TrainBatch) -> ReplayedForward:
        """Proximal logprobs of ``batch`` at the current weights, without gradients.

        Returns:
            :class:`ReplayedForward` with the used and own routing / indexer choices.

        Raises:
            replayrl.rollout.model.ModelInputError / replayrl.trainer.loss.logprobs.LogprobError: a malformed trace
                or support row.
        """

    @abstractmethod
    def train_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Logprobs of ``batch`` (float32 [N], nats) with gradients to the policy weights.

        Raises:
            as :meth:`preflight_logprobs`.
        """

    own_indexer: bool = True
    """Whether the training forward computes the model's own indexer top-k where the indexer
    replay covers every query (:meth:`set_own_indexer`)."""

    def set_own_indexer(self, on: bool) -> None:
        """Whether this update's training forwards compute the model's own indexer top-k where
        the batch's indexer trace replays every real query (``--indexer-drift-interval``); off,
        their ``own_indexer_topk`` may be None. Preflight forwards always compute it. A backend
        that cannot skip it (megatron, the families' transformers models) computes it anyway."""
        self.own_indexer = bool(on)

    def train_forward(self, batch: TrainBatch) -> ReplayedForward:
        """The training forward with the discrete choices it made (one forward, not two).

        Its ``logprobs`` carry gradients (unlike :meth:`preflight_logprobs`); detached, they
        are the proximal logprobs when the step has one optimizer step and nothing needs them
        before the update (the TrainerActor's no-preflight path). A backend that cannot return
        its choices from the training forward keeps this default, and the actor runs the
        preflight instead.

        Raises:
            NotImplementedError: this backend does not provide it.
        """
        raise NotImplementedError(f"{type(self).__name__} has no train_forward")

    def forward_backward(self, batch: TrainBatch,
                         loss_fn: Callable[[torch.Tensor], torch.Tensor], *,
                         capture: bool = False) -> ReplayedForward:
        """One microbatch's training forward and the backward of ``loss_fn(logprobs)``.

        The update's one entry point per microbatch: a backend whose loss exists on only some
        of its ranks (the last stage of a pipeline, docs/design/megatron.md#pipeline-parallel)
        runs ``loss_fn`` there and its backward through every rank.
        This implementation is :meth:`train_forward` (``capture``) or :meth:`train_logprobs`,
        ``loss_fn`` and :meth:`backward`.

        Args:
            batch: the microbatch.
            loss_fn: float32 [N] logprobs (with gradients) -> scalar loss to back-propagate.
            capture: also return the routing / indexer choices the forward made.

        Returns:
            :class:`ReplayedForward` with the logprobs DETACHED (float32 [N], on every rank)
            and, with ``capture``, the choices (else None fields).

        Raises:
            as :meth:`train_logprobs` / :meth:`train_forward`.
        """
        out = self.train_forward(batch) if capture else ReplayedForward(
            self.train_logprobs(batch), None, None, None, None)
        self.backward(loss_fn(out.logprobs))
        return dataclasses.replace(out, logprobs=out.logprobs.detach())

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop accumulated gradients (the start of a step)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of the scalar ``loss`` of one microbatch."""

    @abstractmethod
    def clip_and_step(self, max_norm: float) -> float:
        """Clip the accumulated gradients to total L2 norm ``max_norm`` and apply the optimizer.

        Returns:
            the total gradient norm before clipping. When it is not finite, the gradients are
            dropped and neither the weights nor the optimizer state change (the caller raises).
        """

    @abstractmethod
    def weights(self) -> dict[str, np.ndarray]:
        """The full weight set under Hugging Face parameter names (what engines load)."""

    def push_tensors(self, full: bool = True) -> dict[str, torch.Tensor]:
        """The tensors of a weight push under Hugging Face names, in push order: the full
        weight set, or under LoRA the adapter factors (:mod:`replayrl.rollout.model.adapters`),
        after the base weights when ``full`` (the first push, a restarted engine). Floating
        tensors on the backend's device (float32 unless a backend says otherwise); they may be
        views of the live weights, which the weight sync (:mod:`replayrl.rollout.weight_sync`)
        copies before they next change. A collective of every rank when :attr:`collective_io`
        (rank 0's result is pushed). By default :meth:`weights` as tensors (no copy)."""
        with warnings.catch_warnings():  # read-only arrays: the tensors are only read
            warnings.simplefilter("ignore", UserWarning)
            return {name: torch.from_numpy(np.ascontiguousarray(a))
                    for name, a in self.weights().items()}

    # -- where the weights live (a weight sync that moves them: the shm sync's live path) -----
    _weight_hook: Callable[[], None] | None = None

    def movable_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights as :meth:`push_tensors` gives them without LoRA, when they can be moved
        into one flat float32 CPU buffer (:meth:`move_weights`): one process's policy on the
        CPU, every tensor float32 in its own contiguous storage. None (the default): they
        cannot, and every push is copied."""
        return None

    def move_weights(self, flat: torch.Tensor) -> None:
        """Point every weight of :meth:`movable_weights` at its slice of ``flat`` (1-D float32
        CPU, their total numel, in that order), values copied; the optimizer keeps its
        parameters.

        Raises:
            NotImplementedError: a backend whose :meth:`movable_weights` is None.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps its weights where they are")

    def before_weight_change(self, hook: Callable[[], None] | None) -> None:
        """Have ``hook()`` run before each write of the weights (an optimizer step, a
        checkpoint load); None removes it. A weight sync whose last push may still be read out
        of the weights moves them away first (the shm sync)."""
        self._weight_hook = hook

    def _weights_will_change(self) -> None:
        """Call before writing the weights: runs the :meth:`before_weight_change` hook."""
        if self._weight_hook is not None:
            self._weight_hook()

    @abstractmethod
    def save_checkpoint(self, directory: Path, version: int) -> None:
        """Write the model (Hugging Face format), optimizer and RNG state and ``version``.

        Raises:
            OSError: ``directory`` is not writable.
        """

    @abstractmethod
    def save_hf(self, directory: Path) -> None:
        """Write the current weights as a Hugging Face checkpoint directory that transformers
        loads, with the run's tokenizer (``--save-hf``; docs/design/model.md#hf-checkpoints).

        Raises:
            OSError: ``directory`` is not writable.
        """

    @classmethod
    @abstractmethod
    def check_checkpoint(cls, directory: Path, config) -> int:
        """Read and check :meth:`save_checkpoint` output without a policy in memory (the
        launcher's check of ``--load`` before any actor starts) against the run's trainer
        ``config`` (a ``replayrl.trainer.config.TrainerConfig``, not imported here: that module imports
        the backend registry; its parallel layout); returns its version.

        Raises:
            replayrl.trainer.backends.checkpoint_layout.CheckpointLayoutError (a ValueError): another
                backend's checkpoint, or one saved under a layout other than ``config``'s.
            replayrl.rollout.model.CheckpointError / ValueError: a missing, truncated or malformed file
                (named).
        """

    @abstractmethod
    def load_checkpoint(self, directory: Path, min_version: int = 0) -> int:
        """Restore :meth:`save_checkpoint` output; returns the trainer version saved with it.
        Atomic: everything is read and checked before anything changes; a saved version below
        ``min_version`` raises ``replayrl.actors.version_clock.VersionRegression``.

        Weights, optimizer state and RNG come from the checkpoint; every setting of this run's
        config (learning rate, weight decay, betas, ...) stays as configured, never replaced by
        the checkpoint's: a flag given at resume is what runs and what config.json records.

        Raises:
            OSError / ValueError: a missing or unreadable checkpoint.
        """

    @abstractmethod
    def parameter_count(self) -> int:
        """Number of scalar parameters of the policy."""

    @abstractmethod
    def digest(self) -> dict[str, bytes]:
        """Raw bytes of every weight (``param/<name>``) and optimizer moment (``opt/<i>/<key>``),
        for bitwise comparisons in tests."""
