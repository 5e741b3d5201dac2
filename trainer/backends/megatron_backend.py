"""The megatron-core trainer backend (``--train-backend megatron``), on CPU with gloo or on GPUs.

:class:`MegatronBackend` is a :class:`replayrl.trainer.backends.base.TrainerBackend` whose policy is a
megatron-core ``GPTModel`` (:mod:`replayrl.trainer.backends.megatron_model`) wrapped in megatron's
``DistributedDataParallel`` and trained with megatron's optimizer (Adam with decoupled weight
decay, the distributed optimizer when data parallelism is on), loaded from and exported to the
same Hugging Face checkpoint the engines hold (:mod:`replayrl.trainer.backends.megatron_weights`).

Forward (docs/design/megatron.md#megatron-backend):

* the batch's routing trace is replayed through megatron-core's own ``RouterReplay``
  (:mod:`replayrl.trainer.backends.megatron_replay`), which also returns the experts used and the
  routers' own choice for the flip / drift metrics; the indexer trace through the embedded
  indexer placed in front of megatron's attention (:mod:`replayrl.trainer.backends.megatron_indexer`);
* logits stay vocabulary-parallel (each TP rank holds ``V / tp`` columns); support-replay
  logprobs come from :func:`replayrl.trainer.parallel.vocab_parallel.vocab_parallel_support_logprobs`
  (one MAX and one SUM all-reduce), full-vocabulary ones from megatron's
  ``vocab_parallel_cross_entropy``;
* rows are right-padded, so the causal mask alone keeps real queries off padding keys and
  megatron's RoPE positions ``0 .. S-1`` are the batch's position ids; packed rows
  (``--use-packing``) would need per-segment positions and are refused;
* with context parallelism (``--cp-size``) each rank forwards its 2 of ``2 * cp`` chunks of
  every row, replays the routing trace's matching rows, computes the logprobs of its own
  positions and gathers them back (:mod:`replayrl.trainer.backends.megatron_context_parallel`,
  docs/design/megatron.md#context-parallel).

A family room checkpoint of ``deepseek_v3`` / ``glm4_moe_lite`` is built from megatron-core's MLA
and sigmoid-routed MoE (:mod:`replayrl.trainer.backends.megatron_mla`, docs/design/megatron.md#megatron-families)
and saved back through its transformers model.

Every rank of the world constructs the backend and makes the same calls in the same order
(they are collectives when the world has more than one rank). With pipeline parallelism
(``--pp-size``) each rank holds one stage and every forward goes through megatron-core's
pipeline schedule (:mod:`replayrl.trainer.backends.megatron_pipeline`; docs/design/megatron.md#pipeline-parallel):
the training pass is :meth:`MegatronBackend.forward_backward`,
the logprobs reach every stage from the last one, the captured choices of all stages are
assembled in global layer order.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from replayrl.actors.errors import VersionRegression
from replayrl.rollout.model.checkpoint import load_state_arrays, save_pretrained
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.loader import load_pretrained
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.trainer.backends.base import ReplayedForward, TrainerBackend
from replayrl.trainer.backends.checkpoint_layout import CheckpointLayout, check_layout, refuse_other_backend
from replayrl.trainer.backends.megatron_context_parallel import ContextParallel, row_layout
from replayrl.trainer.backends.megatron_model import MegatronParallel, build_gpt_model, init_parallel
from replayrl.trainer.batching.batch import TrainBatch
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import MegatronModelError
from replayrl.trainer.loss.logprobs import _check_temperature
from replayrl.trainer.parallel.vocab_parallel import vocab_parallel_support_logprobs

__all__ = ["MegatronBackend"]


class MegatronBackend(TrainerBackend):
    """The policy as a megatron-core GPTModel on this rank, trained with megatron's optimizer.

    Args:
        checkpoint_dir: Hugging Face checkpoint directory of the initial policy (every rank
            reads it and keeps its shard).
        config: trainer settings (``torch_threads``, ``seed``, optimizer, replay switches).
        vocab_tokens: the tokenizer vocabulary written with checkpoints.
        parallel: the layout of a world of megatron ranks (torchrun's, every rank constructs
            the backend); None (the trainer ranks of a run): ``--tp-size`` / ``--ep-size`` /
            ``--cp-size`` over
            the trainer ranks' process group (docs/design/trainer-ranks.md#trainer-ranks), or one rank
            in a process group of its own when the run has one trainer rank.

    Raises:
        MegatronModelError: a layout that
            does not fit the world or the model, or ``--use-packing``.
        replayrl.rollout.model.CheckpointError: an unreadable checkpoint.
    """

    def __init__(self, checkpoint_dir: str, config: TrainerConfig, vocab_tokens: Sequence[str],
                 *, parallel: MegatronParallel | None = None) -> None:
        own_world = parallel is None
        parallel = parallel or MegatronParallel(tp=config.tp_size, ep=config.ep_size,
                                                pp=config.pp_size, cp=config.cp_size)
        if parallel.pp > 1 and parallel.cp > 1:
            raise MegatronModelError(f"--cp-size {parallel.cp} with --pp-size {parallel.pp}: "
                                     "context parallelism runs without pipeline stages")
        if config.use_packing:
            raise MegatronModelError("--use-packing is not supported by --train-backend megatron "
                                     "(packed rows need per-segment RoPE positions)")
        self.config, self.parallel = config, parallel
        self.vocab_tokens = list(vocab_tokens)
        self.checkpoint_dir = Path(checkpoint_dir)  # its tokenizer files go with --save-hf
        torch.set_num_threads(config.torch_threads)
        torch.manual_seed(config.seed)
        hf_model, self._model_config = load_pretrained(checkpoint_dir, dtype=torch.float32)
        init_parallel(parallel, config.seed, own_world=own_world)
        self.context = ContextParallel.from_megatron() if parallel.cp > 1 else None

        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from replayrl.trainer.backends.megatron_cpu_compat import cpu_device_scope
        from replayrl.trainer.backends.megatron_replay import RoutingReplay
        from replayrl.trainer.backends.megatron_weights import load_hf_weights

        self._scope = cpu_device_scope
        with self._scope():
            model, tcfg, self.indexer = build_gpt_model(self._model_config, parallel)
            load_hf_weights(model, hf_model.state_dict(), self._model_config)
            del hf_model
            if config.dsa_indexer_loss_coeff:  # before DDP: it buffers the trained parameters
                from replayrl.trainer.backends.megatron_dsa import train_indexer

                train_indexer(model, config.dsa_indexer_loss_coeff)
            self.model = model
            self.routing = RoutingReplay(model, self._model_config) if self._model_config.moe_layers else None
            distributed = ps.get_data_parallel_world_size() > 1
            self.ddp = DistributedDataParallel(
                tcfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model)
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=config.lr, weight_decay=config.weight_decay,
                adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
                clip_grad=config.clip_grad, bf16=False, fp16=False, params_dtype=torch.float32,
                use_distributed_optimizer=distributed), [self.ddp])
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.model.train()

    collective_io = True  # weights, checkpoints: every rank holds shards (TP, EP, optimizer)

    @property
    def model_config(self) -> ModelConfig:
        """The loaded checkpoint's architecture."""
        return self._model_config

    def data_parallel(self) -> tuple[int, int]:
        """megatron's data-parallel rank and size: the tensor-parallel ranks of one
        data-parallel rank train the same share."""
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    # -- forwards -----------------------------------------------------------------------------
    def _forward(self, batch: TrainBatch, capture: bool, loss_fn=None):
        """Logprobs float32 [N] and, with ``capture``, the (used, own) routing and (used, own)
        indexer choices, each ``[B, S_full, L, K]`` or None. Under pipeline parallelism the
        forward is megatron's schedule, with the backward of ``loss_fn(logprobs)`` when given,
        and the logprobs are the last stage's, detached."""
        cfg = self.config
        if self.parallel.pp > 1 and loss_fn is None and torch.is_grad_enabled():
            raise NotImplementedError("under pipeline parallelism logprobs with gradients exist "
                                      "only on the last stage: train with forward_backward")
        t = _check_temperature(cfg.temperature)
        full = batch.tokens.shape[1]
        width = int(batch.pos.max()) + 1 if len(batch.pos) else 1
        # SP splits the sequence evenly over TP ranks, CP into 2 x cp chunks (docs/design/megatron.md#context-parallel)
        width = row_layout(width, self.parallel.cp, self.parallel.tp).total_length
        tokens = torch.zeros(batch.tokens.shape[0], width, dtype=torch.long)
        n = min(width, full)
        tokens[:, :n] = batch.tokens[:, :n]
        positions = torch.arange(width).expand_as(tokens)
        trace = None
        if self.routing is not None and cfg.use_routing_replay and batch.routed_experts is not None:
            trace = batch.routed_experts[:, :n]
            if n < width:
                trace = torch.cat([trace, trace.new_full((trace.shape[0], width - n, *trace.shape[2:]), -1)], 1)
        cp = self.context
        if cp is not None:  # this rank's chunks of every row; RoPE slices itself alike
            tokens, positions = cp.shard(tokens), cp.shard(positions)
            trace = cp.shard(trace) if trace is not None else None
        if self.routing is not None:
            self.routing.begin(trace)
        if self.indexer is not None:
            keys = torch.zeros((tokens.shape[0], width), dtype=torch.bool)  # whole rows under CP
            keys[:, :n] = batch.key_padding_mask[:, :n]
            index = None
            if cfg.use_indexer_replay and batch.indexer_topk is not None:
                index = batch.indexer_topk[:, :n]
                if n < width:
                    index = torch.cat([index, index.new_full((index.shape[0], width - n, *index.shape[2:]), -1)], 1)
            self.indexer.begin(keys, index)
        try:
            with self._scope():
                if self.parallel.pp > 1:
                    from replayrl.trainer.backends.megatron_pipeline import broadcast_from_last_stage, run_schedule

                    logp = run_schedule(self.ddp, tokens, positions,
                                        lambda logits: self._logprobs(logits, batch, t), loss_fn)
                    logp = broadcast_from_last_stage(logp, len(batch.row))
                else:  # logits [B, S / cp, V / tp]
                    logp = self._logprobs(self.ddp(tokens, positions, attention_mask=None), batch, t)
            choices = (None, None, None, None)
            if capture:
                pad = lambda c: torch.cat([c[:, :full], c.new_full(
                    (c.shape[0], max(0, full - c.shape[1]), *c.shape[2:]), -1)], 1)
                routing = self.routing.collect(tokens.shape[0]) if self.routing is not None else None
                if cp is not None and routing is not None:  # [B, S / cp, ...] -> [B, S, ...]
                    routing = tuple(cp.gather(c, 1) for c in routing)
                index = self.indexer.collect() if self.indexer is not None else None
                if self.parallel.pp > 1:  # each stage captured its own layers' columns
                    from replayrl.trainer.backends.megatron_pipeline import gather_stage_choices

                    mc = self._model_config
                    if self.routing is not None:
                        routing = gather_stage_choices(self.routing.layers, mc.moe_layers, routing)
                    if self.indexer is not None:
                        index = gather_stage_choices(self.indexer.layers, mc.indexed_layers, index)
                choices = tuple(None if c is None else pad(c)
                                for pair in (routing, index) for c in (pair or (None, None)))
        finally:
            if self.routing is not None:
                self.routing.end()
            if self.indexer is not None:
                self.indexer.end()
        return logp, choices

    def _logprobs(self, logits: torch.Tensor, batch: TrainBatch, t: float) -> torch.Tensor:
        """float32 [N] logprobs of ``batch``'s response tokens from vocabulary-parallel logits
        ``[B, S / cp, V / tp]`` (support replay, or the full vocabulary); under context
        parallelism each rank computes its own positions' and they are gathered back
        (docs/design/megatron.md#context-parallel)."""
        def of(rows: torch.Tensor, select) -> torch.Tensor:  # the tokens `select` (None: all)
            pick = (lambda a: a) if select is None else (lambda a: a[select])
            rows = rows.float()
            if batch.support is not None:
                return vocab_parallel_support_logprobs(rows, pick(batch.support), t, group=self.tp_group)
            from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

            targets = pick(batch.targets)
            logp = -vocab_parallel_cross_entropy(rows / t, targets.long())
            return torch.where(targets >= 0, logp, torch.zeros_like(logp))

        if self.context is None:
            return of(logits[batch.row, batch.pos], None)
        return self.context.logprobs(logits, batch.row, batch.pos, of)

    def preflight_logprobs(self, batch: TrainBatch) -> ReplayedForward:
        """See :meth:`TrainerBackend.preflight_logprobs` (a no-grad, capturing forward)."""
        with torch.no_grad():
            logp, choices = self._forward(batch, capture=True)
        return ReplayedForward(logp.detach(), *choices)

    def train_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """See :meth:`TrainerBackend.train_logprobs`."""
        return self._forward(batch, capture=False)[0]

    def train_forward(self, batch: TrainBatch) -> ReplayedForward:
        """See :meth:`TrainerBackend.train_forward` (a capturing forward with gradients)."""
        logp, choices = self._forward(batch, capture=True)
        return ReplayedForward(logp, *choices)

    def forward_backward(self, batch: TrainBatch, loss_fn, *, capture: bool = False) -> ReplayedForward:
        """See :meth:`TrainerBackend.forward_backward`; under pipeline parallelism one pass of
        megatron's schedule (forward through every stage, ``loss_fn`` on the last, backward
        through every stage), the logprobs broadcast from the last stage."""
        if self.parallel.pp == 1:
            return super().forward_backward(batch, loss_fn, capture=capture)
        logp, choices = self._forward(batch, capture=capture, loss_fn=loss_fn)
        return ReplayedForward(logp, *choices)

    # -- update -------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """See :meth:`TrainerBackend.zero_grad` (DDP gradient buffers and the optimizer)."""
        with self._scope():
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        """See :meth:`TrainerBackend.backward` (into megatron's gradient buffers)."""
        with self._scope():
            loss.backward()

    def clip_and_step(self, max_norm: float) -> float:
        """See :meth:`TrainerBackend.clip_and_step`: megatron's ``finalize_model_grads`` (DP
        reduction, SP norm gradients), the global gradient norm over all model-parallel ranks,
        clip to ``max_norm``, optimizer step; nothing is applied when the norm is not finite."""
        from megatron.core.distributed import finalize_model_grads

        with self._scope():
            finalize_model_grads([self.ddp])
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            if not math.isfinite(grad_norm):
                self.zero_grad()
                return grad_norm
            from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

            for opt in self._optimizers():  # dense and expert optimizers share one norm
                params = opt.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm=float(max_norm), total_norm=grad_norm)
            self.optimizer.step_with_ready_grads()
        return grad_norm

    def _optimizers(self) -> list:
        """megatron's per-group optimizers (dense, and expert parameters under EP)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _inner_states(self) -> list[dict]:
        return [opt.optimizer.state_dict() for opt in self._optimizers()]

    # -- weights and checkpoints ----------------------------------------------------------------
    def weights(self) -> dict[str, np.ndarray]:
        """See :meth:`TrainerBackend.weights` (gathered from every rank: a collective)."""
        from replayrl.trainer.backends.megatron_weights import gather_hf_weights

        with self._scope():
            return gather_hf_weights(self.model, self._model_config)

    def _hf_model(self) -> Qwen3MoeForCausalLM:
        """The gathered weights in the policy's Hugging Face model (the embedded model, or a
        family room policy's transformers model) for ``save_pretrained``; a collective."""
        if isinstance(self._model_config, ModelConfig):
            model = Qwen3MoeForCausalLM(self._model_config)
        else:  # a family room policy (docs/design/megatron.md#megatron-families)
            from replayrl.rollout.model.families.base import FamilyModel

            with torch.random.fork_rng(devices=[]):  # its random init draws from torch's RNG
                model = FamilyModel.from_config(self._model_config)
        load_state_arrays(model, self.weights())
        return model

    def save_checkpoint(self, directory: Path, version: int) -> None:
        """``directory/model`` (HF format, written by rank 0) and
        ``directory/trainer_state.rank<r>.pt`` per rank (this rank's optimizer shard state,
        ``version``, torch RNG state, and the world's ``layout``: the shards fit no other, see
        :mod:`replayrl.trainer.backends.checkpoint_layout`). A collective."""
        model = self._hf_model()
        rank = dist.get_rank()
        directory = Path(directory)
        if rank == 0:
            self._save_pretrained(model, directory / "model")
        torch.save({"optimizer": self._inner_states(), "version": version,
                    "torch_rng": torch.get_rng_state(), "layout": self.layout().record()},
                   directory / f"trainer_state.rank{rank}.pt")
        dist.barrier()

    def _save_pretrained(self, model: Qwen3MoeForCausalLM, directory: Path) -> None:
        if self.vocab_tokens:
            save_pretrained(model, directory, tokens=self.vocab_tokens)
        else:  # an --hf-checkpoint run: that directory's tokenizer files, unchanged
            save_pretrained(model, directory, tokenizer_from=self.checkpoint_dir)

    def save_hf(self, directory: Path) -> None:
        """See :meth:`TrainerBackend.save_hf` (gathered fp32 weights, written by rank 0; a
        collective)."""
        model = self._hf_model()
        if dist.get_rank() == 0:
            self._save_pretrained(model, Path(directory))
        dist.barrier()

    def layout(self) -> CheckpointLayout:
        """This world's megatron layout (megatron's own group sizes), as saved with
        checkpoints."""
        from megatron.core import parallel_state as ps

        return CheckpointLayout(tp=ps.get_tensor_model_parallel_world_size(),
                                pp=ps.get_pipeline_model_parallel_world_size(),
                                cp=ps.get_context_parallel_world_size(),
                                ep=ps.get_expert_model_parallel_world_size(),
                                dp=ps.get_data_parallel_world_size())

    @classmethod
    def check_checkpoint(cls, directory: Path, config: TrainerConfig) -> int:
        """See :meth:`TrainerBackend.check_checkpoint`: the HF model files load and every
        rank's state file reads (``weights_only``) with one int ``version >= 0``, an
        ``optimizer`` list and the same ``layout``, which must be the one ``config`` asks for
        (:func:`replayrl.trainer.backends.checkpoint_layout.check_layout`; a file without one, from
        before layouts were recorded, passes when the file count is the run's rank count);
        returns that version. The shards' shapes are checked by :meth:`load_checkpoint`, which
        needs the model built.

        Raises:
            replayrl.trainer.backends.checkpoint_layout.CheckpointLayoutError: a torch checkpoint, or
                one saved under another layout.
        """
        directory = Path(directory)
        refuse_other_backend(directory, "megatron")
        with torch.random.fork_rng(devices=[]):
            load_pretrained(directory / "model", dtype=torch.float32)
        paths = sorted(directory.glob("trainer_state.rank*.pt"))
        if not paths:
            raise ValueError(f"{directory}: no trainer_state.rank<r>.pt (a megatron checkpoint)")
        states = {path: _read_rank_state(path) for path in paths}
        versions = {s["version"] for s in states.values()}
        if len(versions) != 1:
            raise ValueError(f"{directory}: the ranks' state files disagree on the version: "
                             f"{sorted(versions)}")
        layouts = {_saved_layout(path, s) for path, s in states.items()}
        if len(layouts) != 1:
            raise ValueError(f"{directory}: the ranks' state files disagree on the layout: "
                             f"{sorted(x.flags() if x else 'none' for x in layouts)}")
        check_layout(directory, layouts.pop(), len(paths), CheckpointLayout.of_config(config))
        return versions.pop()

    def load_checkpoint(self, directory: Path, min_version: int = 0) -> int:
        """Restore :meth:`save_checkpoint` output; the optimizer's hyperparameters stay this
        run's (as :meth:`replayrl.trainer.backends.torch_backend.TorchBackend.load_checkpoint`).
        Everything is read and checked (files, version against ``min_version``) before any
        weight changes.

        Raises:
            replayrl.actors.version_clock.VersionRegression: the saved version is below ``min_version``.
            replayrl.trainer.backends.checkpoint_layout.CheckpointLayoutError: a torch checkpoint, or
                one saved under another layout than this world's.
            replayrl.rollout.model.CheckpointError: unreadable model files. ValueError: an unreadable
                or malformed state file.
        """
        from replayrl.trainer.backends.megatron_weights import load_hf_weights

        directory = Path(directory)
        refuse_other_backend(directory, "megatron")
        path = directory / f"trainer_state.rank{dist.get_rank()}.pt"
        # checked again here (the launcher did before any process started): shards of another
        # layout may load with wrong shapes and fail only at the first optimizer step; a rank
        # beyond the saved world has no file, so rank 0's tells the layout
        probe = path if path.exists() else directory / "trainer_state.rank0.pt"
        state = _read_rank_state(probe)
        check_layout(directory, _saved_layout(probe, state),
                     len(list(directory.glob("trainer_state.rank*.pt"))), self.layout())
        if probe != path:
            state = _read_rank_state(path)
        if state["version"] < min_version:
            raise VersionRegression(f"checkpoint {directory} is at version {state['version']}, "
                                    f"behind the trainer's {min_version}; versions never move "
                                    f"backwards")
        with torch.random.fork_rng(devices=[]):
            model, _ = load_pretrained(directory / "model", dtype=torch.float32)
        with self._scope():
            load_hf_weights(self.model, model.state_dict(), self._model_config)
        for opt, saved in zip(self._optimizers(), state["optimizer"]):
            inner = opt.optimizer
            configured = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
            inner.load_state_dict(saved)
            for group, settings in zip(inner.param_groups, configured):
                group.update(settings)
        torch.set_rng_state(state["torch_rng"])
        return int(state["version"])

    def parameter_count(self) -> int:
        """See :meth:`TrainerBackend.parameter_count` (the full policy, all ranks)."""
        return int(sum(a.size for a in self.weights().values()))

    def digest(self) -> dict[str, bytes]:
        """See :meth:`TrainerBackend.digest` (full weights under HF names, this rank's
        optimizer moments)."""
        arrays = {f"param/{k}": v for k, v in self.weights().items()}
        for j, inner in enumerate(self._inner_states()):
            for i, st in inner["state"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in st:
                        arrays[f"opt/{j}.{i}/{key}"] = st[key].numpy()
        return {k: np.ascontiguousarray(v).tobytes() for k, v in arrays.items()}


def _saved_layout(path: Path, state: dict) -> CheckpointLayout | None:
    """The ``layout`` a rank's state file records; None for a file from before layouts were
    recorded. Raises ValueError: a malformed record (names the file)."""
    return CheckpointLayout.from_record(state["layout"], path) if "layout" in state else None


def _read_rank_state(path: Path) -> dict:
    """One rank's ``trainer_state.rank<r>.pt`` (``weights_only``: no pickle code runs), checked.

    Raises:
        ValueError: unreadable, or without ``optimizer`` (list), ``version`` (int >= 0) and
            ``torch_rng`` (names the file and the field). ``layout`` is optional (files from
            before it was recorded lack it).
    """
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, zip / pickle errors, EOFError...
        raise ValueError(f"{path}: unreadable trainer state: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict) or not {"optimizer", "version", "torch_rng"} <= set(state):
        raise ValueError(f"{path}: expected the keys optimizer, version, torch_rng")
    if type(state["version"]) is not int or state["version"] < 0:
        raise ValueError(f"{path}: version must be an int >= 0, got {state['version']!r}")
    if not isinstance(state["optimizer"], list):
        raise ValueError(f"{path}: optimizer must be a list of optimizer states")
    return state
