"""The torch trainer backend: the embedded fp32 Qwen3-MoE policy, AdamW; one rank, DDP, or parallelized.

:class:`TorchBackend` is the first :class:`replayrl.trainer.backends.base.TrainerBackend`
(``--train-backend torch``, the default). Its forward is :func:`response_logprobs`. In a
process group of several trainer ranks (``--dp-size N``, docs/design/trainer-ranks.md#trainer-ranks)
every rank holds the whole policy and its training forward runs under torch's
``DistributedDataParallel``, which averages the gradients over the ranks in backward; with one
rank the model is called directly, as before. Given a ``parallelize`` step (a function that
wraps the policy in place, as torchtitan's ``parallelize`` does) the same body trains the
policy that step made: the fsdp backend (:mod:`replayrl.trainer.backends.fsdp_backend`) is this
backend with FSDP2's ``fully_shard`` as that step, on its rank's device.

Which forwards use what (documented choice, docs/design/trainer-math.md#trainer-math):
- the proximal (preflight) forward and the policy (training) forward both replay routing and
  indexer traces and normalise over the captured support, so ``logp_prox - logp_rollout``
  measures only numerics, not a different distribution;
- a reference / KL forward (not used by the default GRPO loss) would use the full vocabulary,
  because a KL to a reference policy is defined over the model's own distribution.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from replayrl.actors.device import compute_dtype, process_device
from replayrl.rollout.model.checkpoint import save_pretrained, state_dict_arrays
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.families.base import FamilyConfig, FamilyModel
from replayrl.rollout.model.loader import load_pretrained
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.trainer.backends.base import ReplayedForward, TrainerBackend
from replayrl.trainer.backends.checkpoint_files import (
    check_version,
    check_weights_fit,
    read_policy,
    read_trainer_state,
)
from replayrl.trainer.backends.checkpoint_layout import refuse_other_backend
from replayrl.trainer.backends.optimizer import FusedAdamW
from replayrl.trainer.backends.shards import full_value, local_shard
from replayrl.trainer.batching.batch import TrainBatch
from replayrl.trainer.batching.prefix_tree import PrefixTree
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.lora import peft_adapter as lora
from replayrl.trainer.lora.settings import target_modules
from replayrl.trainer.loss.logprobs import (
    full_vocab_logprobs,
    fused_support_logprobs,
    support_entropy,
    support_logprobs,
)

__all__ = ["TorchBackend", "Parallelize", "response_logprobs"]

Parallelize = Callable[[torch.nn.Module], None]
"""A step that wraps the policy in place for its ranks (FSDP2's ``fully_shard`` per decoder
layer and the root: :func:`replayrl.trainer.backends.fsdp_backend.fully_shard_policy`)."""


def response_logprobs(model: Qwen3MoeForCausalLM, batch: TrainBatch, temperature: float,
                      *, replay_routing: bool = True, replay_indexer: bool = True,
                      capture: bool = False, chunk_size: int = 0,
                      entropy_out: list | None = None,
                      own_indexer: bool = True) -> tuple[torch.Tensor, object]:
    """Logprobs of every response token of ``batch`` (float32 [N]) and the model output.

    Support replay is used when ``batch.support`` is set, else the full-vocabulary logprob.
    With ``chunk_size > 0`` (``--logprobs-chunk-size``) and a support, the fused path projects
    only the candidate tokens from the hidden states, ``chunk_size`` rows at a time, and the
    [B, S, V] logits are never computed. The batch's routing / indexer traces are replayed when
    present and enabled.

    ``own_indexer`` False: the embedded model's indexed layers skip their own top-k where the
    batch's indexer trace replays every real query (``out.own_indexer_topk`` is then None;
    ``Qwen3MoeForCausalLM.forward``); other models ignore it.

    With ``entropy_out`` (a list), the per-token support entropy (float32 [N], nats, detached;
    :func:`replayrl.trainer.loss.logprobs.support_entropy`, docs/design/trainer-math.md#trainer-math) is appended to it
    when the logits exist (a support and no fused path); nothing is appended otherwise.

    Returns:
        ``(logprobs, out)``: float32 [N] (nats, response tokens in batch order; differentiable
        unless under ``torch.no_grad``) and the model's
        :class:`replayrl.rollout.model.qwen3_moe.CausalLMOutput` (used / own choices when ``capture``).

    Raises:
        replayrl.rollout.model.ModelInputError: a malformed trace. replayrl.trainer.loss.logprobs.LogprobError: a
            malformed support row.
    """
    fused = chunk_size > 0 and batch.support is not None
    # Only positions up to the last predicting one are forwarded: the longest samples' last
    # token predicts nothing and, by causality, is no key of any forwarded query (the engine
    # never forwards it either). The choices captured are padded back to the batch's width
    # with -1 rows ("nothing captured"), the rows the batch's own traces hold there.
    width, full = int(batch.pos.max()) + 1 if len(batch.pos) else 1, batch.tokens.shape[1]
    cut = (lambda t: t if t is None or width == full else t[:, :width])
    inputs = dict(tokens=cut(batch.tokens), position_ids=cut(batch.position_ids),
                  key_padding_mask=cut(batch.key_padding_mask),
                  routed_experts=cut(batch.routed_experts) if replay_routing else None,
                  indexer_topk=cut(batch.indexer_topk) if replay_indexer else None)
    # The shared prefix ends with the earliest predicting position (the last prompt token):
    # its logits are the same for every row of a group.
    prefix = int(batch.pos.min()) + 1 if len(batch.pos) else 0
    # a family model (rollout/model/families/) has no packed segments: no prefix tree
    tree_ok = getattr(model, "supports_segment_ids", True)
    skip = {} if own_indexer or not isinstance(model, Qwen3MoeForCausalLM) else {"own_indexer": False}
    shared = None if batch.segment_ids is not None or not len(batch.pos) or not tree_ok else _shared_prefix(
        inputs, prefix)
    if shared is not None:
        tree = PrefixTree.build(shared[0], width, *shared[1:])
        out, at_predicting = _tree_forward(model, inputs, tree, batch.row, batch.pos,
                                           capture=capture, fused=fused, **skip)
    else:
        out = model(inputs["tokens"], inputs["position_ids"],
                    key_padding_mask=inputs["key_padding_mask"],
                    routed_experts=inputs["routed_experts"], indexer_topk=inputs["indexer_topk"],
                    capture=capture, return_hidden=fused, compute_logits=not fused,
                    segment_ids=cut(batch.segment_ids), **skip)
        at_predicting = (out.hidden if fused else out.logits)[batch.row, batch.pos]
    if capture and width < full:
        pad = lambda t: None if t is None else torch.cat(
            [t, t.new_full((t.shape[0], full - width, *t.shape[2:]), -1)], dim=1)
        out = dataclasses.replace(out, routed_experts=pad(out.routed_experts),
                                  indexer_topk=pad(out.indexer_topk),
                                  own_routed_experts=pad(out.own_routed_experts),
                                  own_indexer_topk=pad(out.own_indexer_topk))
    if fused:
        return fused_support_logprobs(at_predicting, lora.head_weight(model.lm_head), batch.support,
                                      temperature, chunk_size), out
    logits = at_predicting.float()
    if batch.support is not None:
        if entropy_out is not None:
            with torch.no_grad():
                entropy_out.append(support_entropy(logits.detach(), batch.support, temperature))
        return support_logprobs(logits, batch.support, temperature), out
    return full_vocab_logprobs(logits, batch.targets, temperature), out


def _shared_prefix(inputs: dict, prefix: int) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """``(prefix, first, inverse)`` when rows share their first ``prefix`` positions, else None.

    The first ``prefix`` positions (up to the earliest predicting one) are forwarded once per
    distinct row (:class:`replayrl.trainer.batching.prefix_tree.PrefixTree`) when every row is real there
    and rows with equal tokens there also carry equal
    positions and routing / indexer traces (the samples of a GRPO group share their prompt,
    and the engine forwarded it identically for each). ``first`` (int64 [U]) is the first row
    of each distinct prefix, ``inverse`` (int64 [B]) the distinct prefix of every row.
    """
    tokens = inputs["tokens"]
    if prefix < 1 or not bool(inputs["key_padding_mask"][:, :prefix].all()):
        return None
    _, inverse = torch.unique(tokens[:, :prefix], dim=0, return_inverse=True)
    n = int(inverse.max()) + 1
    if n == tokens.shape[0]:
        return None  # nothing shared
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((n,), len(inverse), dtype=torch.int64, device=inverse.device).scatter_reduce(
        0, inverse, rows, "amin")
    for name in ("position_ids", "routed_experts", "indexer_topk"):
        t = inputs[name]
        if t is not None and not torch.equal(t[:, :prefix], t[first][inverse][:, :prefix]):
            return None
    return prefix, first, inverse


def _tree_forward(model: Qwen3MoeForCausalLM, inputs: dict, tree: PrefixTree, row: torch.Tensor,
                  pos: torch.Tensor, *, capture: bool, fused: bool, **model_kwargs):
    """The forward of :func:`response_logprobs` in the prefix-tree layout (trainer/batching/prefix_tree.py):
    each shared prefix once, every row's continuation as a branch after it, one forward.

    ``row``, ``pos`` (int64 [N]): the predicting positions. Returns the model output with the
    captured choices in every row's own layout [B, W, ...] (logits / hidden stay in the tree
    layout) and the logits (or, ``fused``, the final hidden states) at every predicting
    position, [N, V] (or [N, H])."""
    to_tree = lambda name, fill: None if inputs[name] is None else tree.to_tree(inputs[name], fill)
    indexer = inputs["indexer_topk"]
    out = model(to_tree("tokens", 0), to_tree("position_ids", 0),
                key_padding_mask=to_tree("key_padding_mask", False),
                routed_experts=to_tree("routed_experts", -1),
                indexer_topk=None if indexer is None else tree.to_tree(
                    tree.indexer_to_tree(indexer), -1),
                capture=capture, return_hidden=fused, compute_logits=not fused,
                segment_ids=tree.segment_ids(), **model_kwargs)
    at_predicting = tree.at(out.hidden if fused else out.logits, row, pos)
    if capture:
        rows = lambda t: None if t is None else tree.from_tree(t)
        slots = lambda t: None if t is None else tree.indexer_from_tree(t)
        out = dataclasses.replace(
            out, routed_experts=rows(out.routed_experts), indexer_topk=slots(out.indexer_topk),
            own_routed_experts=rows(out.own_routed_experts),
            own_indexer_topk=slots(out.own_indexer_topk))
    return out, at_predicting


class _LogprobForward(torch.nn.Module):
    """:func:`response_logprobs` as one module call: torch's ``DistributedDataParallel``
    needs the whole training forward of a microbatch (the prefix-tree forward and the LM-head
    projection of the fused path) to be its wrapped module's forward."""

    def __init__(self, policy: Qwen3MoeForCausalLM) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, batch: TrainBatch, temperature: float, **kwargs):
        """:func:`response_logprobs` of ``self.policy``."""
        return response_logprobs(self.policy, batch, temperature, **kwargs)


class TorchBackend(TrainerBackend):
    """The fp32 policy loaded from a Hugging Face checkpoint, trained with AdamW in-process.

    Args:
        checkpoint_dir: Hugging Face checkpoint directory of the initial policy.
        config: trainer settings (``torch_threads`` and ``seed`` set this process's torch
            intra-op threads and global seed, before the model is built).
        vocab_tokens: the tokenizer vocabulary written with checkpoints; empty: the tokenizer
            files of ``checkpoint_dir`` are copied into every checkpoint instead (a run from
            ``--hf-checkpoint``).
        device: where the policy, its gradients and its optimizer state live; None: this
            process's device for ``config.device`` (:func:`replayrl.actors.device.process_device`;
            the CPU, or this rank's CUDA device). A batch is moved there for each forward and
            what the forward returns comes back to the CPU. On a CUDA device with bf16 the
            forwards run under ``torch.autocast`` in bf16 over the fp32 weights (the master
            weights the optimizer updates), unless a ``parallelize`` step brings its own mixed
            precision (:attr:`compute_dtype`); elsewhere everything is float32.
        parallelize: a :data:`Parallelize` step applied to the policy after its LoRA adapters
            are added and before the optimizer takes its parameters (then no DDP); None: the
            whole policy on every rank, under DDP with several ranks.

    Raises:
        replayrl.rollout.model.CheckpointError / ModelConfigError: an unreadable checkpoint.
    """

    compute_dtype: torch.dtype | None = None
    """The ``torch.autocast`` dtype of every forward (bf16 on a CUDA device that has it:
    :func:`replayrl.actors.device.compute_dtype`), or None: the forwards compute in the weights'
    float32."""
    lora_config = None
    """The ``peft.LoraConfig`` of a LoRA run (``--lora-rank``, :mod:`replayrl.trainer.lora.peft_adapter`),
    else None."""
    experts_hooked = False
    """Whether the policy's MoE blocks adapt their experts themselves
    (:func:`replayrl.trainer.lora.peft_adapter.hook_experts`, a parallelized policy); else every
    forward runs under :func:`replayrl.trainer.lora.peft_adapter.experts_adapted`."""

    def __init__(self, checkpoint_dir: str, config: TrainerConfig,
                 vocab_tokens: Sequence[str], *, device: torch.device | None = None,
                 parallelize: Parallelize | None = None) -> None:
        self.config = config
        torch.set_num_threads(config.torch_threads)
        torch.manual_seed(config.seed)
        self.device = process_device(config.device) if device is None else device
        # a parallelize step (FSDP2's mixed-precision policy) casts for itself
        self.compute_dtype = compute_dtype(self.device) if parallelize is None else None
        self.model, self._model_config = load_pretrained(checkpoint_dir, dtype=torch.float32)
        self.model.to(self.device)
        self.model.train()
        if config.lora_rank:  # trainer/lora/peft_adapter.py: only the adapters train
            self.lora_config = lora.add_adapters(self.model, config.lora_rank, config.lora_alpha,
                                                 target_modules(config.lora_target_modules),
                                                 config.seed)
            # adapted HF weight name -> its adapter (a sharded policy's push and checkpoint
            # split the gathered state with it)
            self._adapted = lora.adapted_weights(self.model)
            if parallelize is not None:
                # a parallelized policy's expert weights are whole only inside their block's
                # forward (FSDP2 gathers them there): the experts are adapted there too
                lora.hook_experts(self.model)
                self.experts_hooked = True
        if parallelize is not None:
            parallelize(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self._make_optimizer()
        self.vocab_tokens = list(vocab_tokens)
        self.checkpoint_dir = checkpoint_dir
        self.ddp = None
        if parallelize is None and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank loaded the same checkpoint (DDP also broadcasts rank 0's weights).
            # No find_unused_parameters: every trainable parameter is in every training
            # forward's graph. The MoE block stacks all experts' weights into one grouped
            # matmul, so an expert no token of this rank's microbatch reached gets a zero
            # gradient, not none; the indexer, whose top-k has no gradient, is frozen
            # (requires_grad False), and DDP skips it. With the flag DDP walked the graph
            # each step to find nothing and warned so once per rank.
            self.ddp = torch.nn.parallel.DistributedDataParallel(_LogprobForward(self.model))

    def _make_optimizer(self) -> FusedAdamW:
        """AdamW over ``self.params`` with the run's settings: torch's fused kernel, without
        ``torch.optim.Optimizer``, whose methods import ``torch._dynamo`` (tens of MiB of RSS in this
        process; :mod:`replayrl.trainer.backends.optimizer`)."""
        cfg = self.config
        return FusedAdamW(self.params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                          eps=cfg.adam_eps, weight_decay=cfg.weight_decay)

    @property
    def model_config(self) -> ModelConfig:
        """The loaded checkpoint's architecture."""
        return self._model_config

    def _forward(self, batch: TrainBatch, capture: bool, entropy_out: list | None = None,
                 train: bool = False) -> tuple[torch.Tensor, object]:
        """:meth:`_policy_forward` on this backend's device; what it returns is on the CPU (the
        logprobs keep their gradient through the copy)."""
        if self.device.type == "cpu":
            return self._policy_forward(batch, capture, entropy_out, train)
        moved = dataclasses.replace(batch, **{
            f.name: getattr(batch, f.name).to(self.device) for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)})
        entropy: list = []
        logp, out = self._policy_forward(moved, capture, entropy, train)
        if entropy_out is not None:
            entropy_out.extend(e.cpu() for e in entropy)
        out = dataclasses.replace(out, **{
            f.name: getattr(out, f.name).cpu() for f in dataclasses.fields(out)
            if f.name not in ("logits", "hidden") and isinstance(getattr(out, f.name), torch.Tensor)})
        return logp.cpu(), out

    def _policy_forward(self, batch: TrainBatch, capture: bool, entropy_out: list | None,
                        train: bool) -> tuple[torch.Tensor, object]:
        """:func:`response_logprobs` with this run's settings, under :attr:`compute_dtype`'s
        autocast when there is one; ``train``: a forward whose backward follows (through DDP
        when there is one)."""
        cfg = self.config
        kwargs = dict(capture=capture, replay_routing=cfg.use_routing_replay,
                      replay_indexer=cfg.use_indexer_replay, chunk_size=cfg.logprobs_chunk_size,
                      entropy_out=entropy_out, own_indexer=self.own_indexer or not train)
        adapted = self.lora_config and not self.experts_hooked
        autocast = (torch.autocast(self.device.type, dtype=self.compute_dtype)
                    if self.compute_dtype is not None else contextlib.nullcontext())
        with lora.experts_adapted(self.model) if adapted else contextlib.nullcontext(), autocast:
            if train and self.ddp is not None:
                return self.ddp(batch, cfg.temperature, **kwargs)
            return response_logprobs(self.model, batch, cfg.temperature, **kwargs)

    def preflight_logprobs(self, batch: TrainBatch) -> ReplayedForward:
        """See :meth:`TrainerBackend.preflight_logprobs` (a no-grad, capturing forward)."""
        entropy: list = []
        with torch.no_grad():
            logp, out = self._forward(batch, capture=True, entropy_out=entropy)
        return ReplayedForward(logp, out.routed_experts, out.own_routed_experts,
                               out.indexer_topk, out.own_indexer_topk,
                               entropy[0] if entropy else None)

    def train_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """See :meth:`TrainerBackend.train_logprobs`."""
        return self._forward(batch, capture=False, train=True)[0]

    def train_forward(self, batch: TrainBatch) -> ReplayedForward:
        """See :meth:`TrainerBackend.train_forward` (a capturing forward with gradients)."""
        entropy: list = []
        logp, out = self._forward(batch, capture=True, entropy_out=entropy, train=True)
        return ReplayedForward(logp, out.routed_experts, out.own_routed_experts,
                               out.indexer_topk, out.own_indexer_topk,
                               entropy[0] if entropy else None)

    def zero_grad(self) -> None:
        """See :meth:`TrainerBackend.zero_grad` (gradients set to None)."""
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        """See :meth:`TrainerBackend.backward`."""
        loss.backward()

    def clip_and_step(self, max_norm: float) -> float:
        """See :meth:`TrainerBackend.clip_and_step` (``torch.nn.utils.clip_grad_norm_``, AdamW);
        a sharded policy's norm is over every rank's gradient shards (the same on every rank)."""
        grad_norm = float(full_value(torch.nn.utils.clip_grad_norm_(self.params, max_norm)))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm
        self._weights_will_change()
        self.optimizer.step()
        # nothing reads the gradients after the step (the next update's zero_grad would drop
        # them): freed now, they are not held beside the weight push's buffer (peak memory)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def weights(self) -> dict[str, np.ndarray]:
        """See :meth:`TrainerBackend.weights` (the engines' dtype conversion is theirs); under
        LoRA the merged policy (base + adapters)."""
        if self.lora_config:
            return {k: v.detach().to(device="cpu", dtype=torch.float32, copy=True).numpy()
                    for k, v in lora.merged_state(self.model).items()}
        return state_dict_arrays(self.model)

    def push_tensors(self, full: bool = True) -> dict[str, torch.Tensor]:
        """See :meth:`TrainerBackend.push_tensors`: the model's float32 state (views of the
        live weights, on this backend's device; a non-float32 tensor as a float32 copy).

        Under LoRA the adapter factors (:func:`replayrl.trainer.lora.peft_adapter.adapter_tensors`),
        after the base weights when ``full`` (a first push, a restarted engine): the engine
        merges them (rollout/model/adapters.py)."""
        if self.lora_config:
            factors = lora.adapter_tensors(self.model)
            if not full:
                return factors
            base = {k: v.detach().float() for k, v in lora.base_state(self.model).items()}
            return {**base, **factors}
        # state_dict's tensors are detached already; float32 ones are passed as they are
        return {k: v if v.dtype == torch.float32 else v.float()
                for k, v in self.model.state_dict().items()}

    def movable_weights(self) -> dict[str, torch.Tensor] | None:
        """See :meth:`TrainerBackend.movable_weights`: the model's state when it is a policy on
        the CPU (host memory), of one process (DDP keeps views of its own), without LoRA, every
        tensor float32 in its own contiguous storage (tied weights would need one place for two
        names)."""
        if self.ddp is not None or self.device.type != "cpu" or self.lora_config:
            return None
        state = self.model.state_dict()
        storages = {t.untyped_storage().data_ptr() for t in state.values()}
        if len(storages) != len(state) or any(t.dtype != torch.float32 or not t.is_contiguous()
                                              for t in state.values()):
            return None
        return state

    def move_weights(self, flat: torch.Tensor) -> None:
        """See :meth:`TrainerBackend.move_weights`: every tensor of the model's state (its
        parameters and persistent buffers) copied into ``flat`` in state order and pointed at
        its slice (``Parameter.data``; the optimizer keeps the same parameter objects).

        Raises:
            ValueError: ``flat`` is not a 1-D float32 tensor of the state's total numel.
        """
        state = self.model.state_dict()
        numel = sum(t.numel() for t in state.values())
        if flat.dim() != 1 or flat.dtype != torch.float32 or flat.numel() != numel:
            raise ValueError(f"move_weights: need a 1-D float32 tensor of {numel} elements, got "
                             f"{flat.dtype} {tuple(flat.shape)}")
        # found by identity, not by name: a wrapper's state_dict may rename (FamilyModel's
        # drops its `hf.` prefix)
        owners: dict[int, tuple[torch.nn.Module, str]] = {}
        for module in self.model.modules():
            for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is not None:
                    owners[id(t)] = (module, attr)
        held = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            torch.cat([t.reshape(-1) for t in state.values()], out=flat)
            offset = 0
            for name, t in state.items():
                view = flat[offset:offset + t.numel()].view(t.shape)
                offset += t.numel()
                module, attr = owners[id(held[name])]
                if attr in module._parameters:
                    module._parameters[attr].data = view
                else:
                    module._buffers[attr] = view

    def save_checkpoint(self, directory: Path, version: int) -> None:
        """``directory/model`` (HF format) and ``directory/trainer_state.pt`` (optimizer state,
        ``version``, torch RNG state). Under LoRA ``model`` is the base and ``directory/adapter``
        peft's adapter files (``peft.PeftModel.from_pretrained(<model loaded from model>,
        directory/adapter)`` is the policy); the optimizer state is the adapters'."""
        if self.lora_config:
            self._save_plain(lora.base_state(self.model), directory / "model")
            lora.save_adapters(self.model, self.lora_config, directory / lora.ADAPTER_DIR, "../model")
        else:
            self.save_hf(directory / "model")
        torch.save({"optimizer": self.optimizer.state_dict(), "version": version,
                    "torch_rng": torch.get_rng_state()}, directory / "trainer_state.pt")

    def save_hf(self, directory: Path) -> None:
        """See :meth:`TrainerBackend.save_hf` (fp32 weights, the run's tokenizer; under LoRA
        the merged policy, base + adapters)."""
        if self.lora_config:
            self._save_plain(lora.merged_state(self.model), directory)
            return
        self._save_plain(None, directory)

    def _save_plain(self, state: dict | None, directory: Path) -> None:
        """Write the policy, or the plain model of ``state`` (HF names), as an HF checkpoint."""
        model = self.model
        if state is not None:  # a LoRA policy: a plain model of these weights (a copy)
            if isinstance(self._model_config, FamilyConfig):
                with torch.random.fork_rng(devices=[]):  # transformers' init draws random weights
                    model = FamilyModel.from_config(self._model_config, torch.float32)
            else:
                model = Qwen3MoeForCausalLM.empty(self._model_config, torch.float32)
            model.load_state_dict(state)
        if self.vocab_tokens:
            save_pretrained(model, directory, tokens=self.vocab_tokens)
        else:
            save_pretrained(model, directory, tokenizer_from=self.checkpoint_dir)

    @classmethod
    def check_checkpoint(cls, directory: Path, config: TrainerConfig) -> int:
        """See :meth:`TrainerBackend.check_checkpoint`: reads ``model`` and ``trainer_state.pt``
        completely, checks the latter's fields, and loads its optimizer state into an optimizer
        over the checkpoint's own parameters (their count and sizes must fit). ``config`` is
        not read: every data-parallel rank holds the whole optimizer state."""
        directory = Path(directory)
        model, state, version = _read_checkpoint(directory, config)
        params = [p for p in model.parameters() if p.requires_grad]  # as __init__ takes them
        try:
            torch.optim.AdamW(params).load_state_dict(state["optimizer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise ValueError(f"{directory}/trainer_state.pt: optimizer state does not fit the "
                             f"checkpoint's model: {type(exc).__name__}: {exc}") from None
        return version

    def load_checkpoint(self, directory: Path, min_version: int = 0) -> int:
        """Restore :meth:`save_checkpoint` output (weights, optimizer, torch RNG); returns the
        saved version.

        Atomic: every file is read and checked against this policy (tensor names and shapes,
        the optimizer state loaded into a probe optimizer over the same parameters, the RNG
        state) before anything changes, so a rejected checkpoint leaves weights, optimizer and
        RNG as they were.

        The optimizer's state (AdamW moments and step counts) comes from the checkpoint, its
        hyperparameters (``lr``, ``betas``, ``weight_decay``, ... of every parameter group) from
        this run's config: ``torch.optim.Optimizer.load_state_dict`` would restore the saved
        ones, so ``--lr`` given at resume would be silently replaced by the checkpoint's.

        Raises:
            replayrl.actors.version_clock.VersionRegression: the saved version is below
                ``min_version`` (the trainer's current one).
            replayrl.rollout.model.CheckpointError: unreadable model files, or tensors that do not match
                this policy (names the tensor). ValueError: an unreadable or malformed
                ``trainer_state.pt``. In every case nothing was changed.
        """
        model, state, version = _read_checkpoint(Path(directory), self.config)
        weights = model.state_dict()
        check_version(directory, version, min_version)
        check_weights_fit(directory, weights, self.model.state_dict())
        probe = self._make_optimizer()
        try:
            probe.load_state_dict(state["optimizer"])  # validates groups, sizes; changes no param
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise ValueError(f"{directory}/trainer_state.pt: optimizer state does not fit this "
                             f"policy: {type(exc).__name__}: {exc}") from None
        # everything checked: swap
        self._weights_will_change()
        self.model.load_state_dict(weights)
        self._load_optimizer_keeping_settings(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        return version

    def _load_optimizer_keeping_settings(self, optimizer_state: dict) -> None:
        """Load saved optimizer moments but keep this run's hyperparameters (``lr``, ``betas``,
        ``eps``, ... per group): ``load_state_dict`` would restore the checkpoint's."""
        configured = [{k: v for k, v in group.items() if k != "params"}
                      for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(optimizer_state)
        for group, settings in zip(self.optimizer.param_groups, configured):
            group.update(settings)

    def parameter_count(self) -> int:
        """See :meth:`TrainerBackend.parameter_count` (the whole policy's, a sharded one's too:
        a ``DTensor`` counts its full shape)."""
        return int(sum(p.numel() for p in self.model.parameters()))

    def digest(self) -> dict[str, bytes]:
        """See :meth:`TrainerBackend.digest`: float32 weights, AdamW moments as they are. A
        sharded policy gives THIS rank's shards (no collective): the shards of ranks
        ``0 .. N-1`` concatenated in rank order are the full tensors' bytes (FSDP2 shards dim 0
        as ``torch.chunk``); a buffer (a DeepSeek / GLM router's ``e_score_correction_bias``)
        is not sharded: every rank gives it whole."""
        arrays = {f"param/{k}": local_shard(v).detach().to(device="cpu", dtype=torch.float32).numpy()
                  for k, v in self.model.state_dict().items()}
        for i, st in self.optimizer.state_dict()["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                arrays[f"opt/{i}/{key}"] = local_shard(st[key]).cpu().numpy()
        return {k: np.ascontiguousarray(v).tobytes() for k, v in arrays.items()}


def _read_checkpoint(directory: Path, config: TrainerConfig) -> tuple[torch.nn.Module, dict, int]:
    """Read ``directory/model`` and ``directory/trainer_state.pt`` and check the latter's fields;
    changes nothing (not even the global RNG). Returns ``(model, trainer state, version)``;
    under ``config``'s LoRA the model carries the adapters of ``directory/adapter``
    (:func:`replayrl.trainer.backends.checkpoint_files.read_policy`).

    Raises:
        replayrl.trainer.backends.checkpoint_layout.CheckpointLayoutError: another backend's checkpoint.
        replayrl.rollout.model.CheckpointError: unreadable model files. ValueError: a missing,
            unreadable or malformed ``trainer_state.pt`` (names the file and the field), or
            adapters that do not fit this run's ``--lora-*`` settings.
    """
    refuse_other_backend(directory, "torch")  # another backend's checkpoint: say so, not "no file"
    model = read_policy(directory, config)
    state = read_trainer_state(directory / "trainer_state.pt")
    return model, state, state["version"]
