"""The FSDP2 trainer backend: the torch backend's policy, sharded over the data-parallel ranks.

:class:`FSDPBackend` (``--train-backend fsdp``) is
:class:`replayrl.trainer.backends.torch_backend.TorchBackend` built on its rank's device with
:func:`fully_shard_policy` as its ``parallelize`` step: the same policy (``load_pretrained``: the
embedded default or an ``--hf-checkpoint`` of a family the loader reads, transformers' model
of that family included: :class:`replayrl.rollout.model.families.base.FamilyModel`, whose router
and indexer hooks capture and replay inside each sharded decoder layer), the same forward
(:func:`replayrl.trainer.backends.torch_backend.response_logprobs`: routing, indexer and
support replay, prefix tree, fused LM head) and the same step, but every parameter, gradient
and AdamW moment sharded over the trainer ranks with torch's FSDP2
(``torch.distributed.fsdp.fully_shard``): one FSDP unit per decoder layer plus the root
(embedding, final norm, LM head), as torchtitan's ``parallelize`` applies it. A rank holds
``1 / --dp-size`` of the weights and optimizer state; each unit's weights are all-gathered for
its forward and backward and freed after, and gradients are reduce-scattered (averaged) in
backward, so the update equals one rank's on the whole batch (docs/design/trainer-ranks.md#trainer-ranks).

Consequences for the rest of the system, which sees the same :class:`TrainerBackend` contract:

- every forward (preflight too) and backward is a collective of all ranks
  (:attr:`collective_forward`): the trainer actor splits preflights exactly, as updates;
- weights, checkpoints and HF saves are collectives (:attr:`collective_io`): every rank joins
  the all-gather, rank 0 alone pushes / writes the full weights; each rank writes its optimizer
  shard to ``fsdp_state.rank<r>.pt`` with the layout record (``--dp-size``), and a resume under
  another ``--dp-size`` is refused before start
  (:mod:`replayrl.trainer.backends.checkpoint_layout`);
- :meth:`digest` is local (this rank's shards, no collective): the shards of ranks
  ``0 .. N-1`` concatenated are the full tensors (FSDP2 shards dim 0 as ``torch.chunk``).
- LoRA (``--lora-rank``, :mod:`replayrl.trainer.lora.peft_adapter`): the adapters are added before
  ``fully_shard`` and sharded with their layer, only they train and sit in AdamW; the push
  (:meth:`push_tensors`) and the checkpoint gather them from the shards and are the torch
  backend's (the factors, after the base on a first push; ``model`` + peft's ``adapter``).

Precision: on CUDA with bf16 the FSDP2 mixed-precision policy computes in bf16 (all-gathered
weights cast once per unit) over fp32 master weights, gradients reduced in fp32; on CPU it is
all fp32, as the torch backend. Without a process group (one rank) the backend makes a
world-size-1 group of its own.
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from replayrl.actors.device import compute_dtype, process_device
from replayrl.rollout.model.adapters import LORA_A_SUFFIX, LORA_B_SUFFIX
from replayrl.rollout.model.checkpoint import load_state_arrays, save_pretrained
from replayrl.rollout.model.families.base import FamilyConfig, FamilyModel
from replayrl.rollout.model.hf_config import read_hf_config
from replayrl.rollout.model.loader import check_weight_files
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.trainer.backends.checkpoint_files import (
    check_version,
    check_weights_fit,
    read_policy,
    read_trainer_state,
)
from replayrl.trainer.backends.checkpoint_layout import CheckpointLayout, check_layout, refuse_other_backend
from replayrl.trainer.backends.shards import full_value, like_param, local_shard, shard_like
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.lora import peft_adapter as lora

__all__ = ["FSDPBackend", "STATE_FILE", "fully_shard_policy"]

STATE_FILE = "fsdp_state.rank{rank}.pt"
"""Per-rank trainer state file of an FSDP checkpoint (optimizer shard, version, RNG, layout)."""


def fully_shard_policy(model: Qwen3MoeForCausalLM | FamilyModel, *, mesh,
                       mp_policy) -> None:
    """FSDP2 over the policy, in place, as torchtitan's ``parallelize`` applies it:
    ``fully_shard`` on every decoder layer (one unit each: its weights all-gathered for its
    forward and backward and freed after, its gradients reduce-scattered), then on the root
    (embedding, final norm, LM head).

    Args:
        mesh: the 1-D ``DeviceMesh`` of the data-parallel ranks the parameters are sharded over.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (compute and reduce dtypes).
    """
    from torch.distributed.fsdp import fully_shard

    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


class FSDPBackend(TorchBackend):
    """The torch backend with :func:`fully_shard_policy` as its parallelize step, on this
    rank's device (``config.device``: :func:`replayrl.actors.device.process_device`, the CUDA
    device of its ``LOCAL_RANK``), AdamW on the sharded parameters.

    Args:
        checkpoint_dir, config, vocab_tokens: as :class:`TorchBackend`.

    Raises:
        replayrl.rollout.model.CheckpointError / ModelConfigError: an unreadable checkpoint.
        RuntimeError (from torch): the process group cannot be made.
    """

    collective_io = True  # weights and checkpoints: every rank holds a shard
    collective_forward = True  # every forward all-gathers weights: shares must be equal

    def __init__(self, checkpoint_dir: str, config: TrainerConfig,
                 vocab_tokens: Sequence[str]) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # FSDP2 warns once that a decoder layer returns views (its cache entry, its choices):
        # an in-place op on one would skip the pre-backward hook; the forward does none
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        if not dist.is_initialized():  # one rank: a group of one, in this process
            dist.init_process_group(_group_backend(), store=dist.HashStore(), rank=0,
                                    world_size=1)
        device = process_device(config.device)  # this rank's CUDA device (LOCAL_RANK), or the CPU
        bf16 = compute_dtype(device) == torch.bfloat16
        # fp32 master weights (the sharded parameters the optimizer updates), bf16 compute
        # where the device has it, gradients reduced in fp32; on CPU everything is fp32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                      reduce_dtype=torch.float32 if bf16 else None)
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        super().__init__(checkpoint_dir, config, vocab_tokens, device=device,
                         parallelize=functools.partial(fully_shard_policy, mesh=self.mesh,
                                                       mp_policy=policy))

    def _make_optimizer(self) -> torch.optim.AdamW:
        """``torch.optim.AdamW(fused=True)`` over the sharded DTensor parameters: its state dict
        and loading handle DTensors, and this process imports torch.distributed's stack anyway
        (the torch backend's :class:`replayrl.trainer.backends.optimizer.FusedAdamW` saves ``torch._dynamo``
        on the one-process path)."""
        cfg = self.config
        return torch.optim.AdamW(self.params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                 eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=True)

    # -- weights out (collectives) -----------------------------------------------------------
    def weights(self) -> dict[str, np.ndarray]:
        """See :meth:`TrainerBackend.weights`: every tensor all-gathered from the shards (a
        collective of every rank), float32 numpy arrays under HF names; under LoRA the merged
        policy (base + ``scaling * B @ A``, as :func:`replayrl.trainer.lora.peft_adapter.merged_state`)."""
        state = self._gathered()
        if self.lora_config:
            state, factors = lora.split_state(state, self._adapted)
            with torch.no_grad():
                for name in self._adapted:
                    state[name] = state[name] + factors[name + LORA_B_SUFFIX] @ factors[name + LORA_A_SUFFIX]
        return _arrays(state)

    def push_tensors(self, full: bool = True) -> dict[str, torch.Tensor]:
        """See :meth:`TrainerBackend.push_tensors`: :meth:`weights` as CPU tensors, or under LoRA
        the adapter factors gathered from the shards (float32 ``N.lora_A`` [r, in], ``N.lora_B``
        [out, r] times the scaling), after the base weights when ``full``: the torch backend's
        LoRA push (:func:`replayrl.trainer.lora.peft_adapter.adapter_tensors`), merged by the
        engine. CPU copies; a collective."""
        if not self.lora_config:
            return self._gathered()  # what weights() gives, as the tensors they are
        base, factors = lora.split_state(self._gathered(), self._adapted)
        return {**base, **factors} if full else factors

    def movable_weights(self) -> None:
        """See :meth:`TrainerBackend.movable_weights`: none, the weights are sharded."""
        return None

    def _gathered(self) -> dict[str, torch.Tensor]:
        """Every state-dict tensor all-gathered from the shards (a collective), float32 CPU
        copies under the model's own names (peft's under LoRA)."""
        with torch.no_grad():
            return {name: full_value(t).detach().to(device="cpu", dtype=torch.float32, copy=True)
                    for name, t in self.model.state_dict().items()}

    def _hf_model(self, arrays: dict[str, np.ndarray] | None = None) -> Qwen3MoeForCausalLM | FamilyModel:
        """An unsharded CPU copy of the policy, or the plain model of ``arrays`` (HF names), (a
        collective without ``arrays``; its copy matters on rank 0)."""
        if isinstance(self._model_config, FamilyConfig):
            with torch.random.fork_rng(devices=[]):  # transformers' init draws random weights
                model = FamilyModel.from_config(self._model_config, torch.float32)
        else:
            model = Qwen3MoeForCausalLM.empty(self._model_config, torch.float32)
        load_state_arrays(model, self.weights() if arrays is None else arrays)
        return model

    def save_hf(self, directory: Path, arrays: dict[str, np.ndarray] | None = None) -> None:
        """See :meth:`TrainerBackend.save_hf`: the weights gathered on every rank (a
        collective), written by rank 0 (fp32, the run's tokenizer); under LoRA the merged
        policy. ``arrays``: write these weights (HF names) instead (no collective but the
        closing barrier)."""
        model = self._hf_model(arrays)
        if dist.get_rank() == 0:
            if self.vocab_tokens:
                save_pretrained(model, directory, tokens=self.vocab_tokens)
            else:
                save_pretrained(model, directory, tokenizer_from=self.checkpoint_dir)
        dist.barrier()  # the directory is complete when any rank returns

    def save_checkpoint(self, directory: Path, version: int) -> None:
        """``directory/model`` (HF format, rank 0) and, per rank,
        ``directory/fsdp_state.rank<r>.pt``: this rank's AdamW state (its shards' moments as
        plain tensors), ``version``, its torch RNG state and the ``layout`` (``dp`` = the
        ranks: the shards fit no other). A collective. Under LoRA, as the torch backend:
        ``model`` is the base and ``directory/adapter`` peft's adapter files (rank 0), the
        optimizer state the adapters'."""
        directory = Path(directory)
        if self.lora_config:
            state = self._gathered()
            base, _ = lora.split_state(state, self._adapted)
            if dist.get_rank() == 0:
                lora.save_adapters(self.model, self.lora_config, directory / lora.ADAPTER_DIR,
                                   "../model", state=state)
            self.save_hf(directory / "model", _arrays(base))
        else:
            self.save_hf(directory / "model")
        state = self.optimizer.state_dict()
        state["state"] = {i: {k: local_shard(v) for k, v in s.items()}
                          for i, s in state["state"].items()}
        torch.save({"optimizer": state, "version": version, "torch_rng": torch.get_rng_state(),
                    "layout": self.layout().record()},
                   directory / STATE_FILE.format(rank=dist.get_rank()))
        dist.barrier()

    def layout(self) -> CheckpointLayout:
        """This world's layout as saved with a checkpoint: data-parallel ranks only."""
        return CheckpointLayout(dp=dist.get_world_size())

    @classmethod
    def check_checkpoint(cls, directory: Path, config: TrainerConfig) -> int:
        """See :meth:`TrainerBackend.check_checkpoint`: ``model`` (config and weight-file
        headers) and every rank's state file are read and checked; their layout must be the
        one ``config`` asks for (``--dp-size``; the optimizer state is sharded by it)."""
        directory = Path(directory)
        refuse_other_backend(directory, "fsdp")
        read_hf_config(directory / "model")
        check_weight_files(directory / "model")
        if config.lora_rank:  # the adapters must load into this run's LoRA policy
            read_policy(directory, config)
        paths = sorted(directory.glob(STATE_FILE.format(rank="*")))
        if not paths:
            raise ValueError(f"{directory}: no {STATE_FILE.format(rank='<r>')} (an fsdp checkpoint)")
        states = {path: read_trainer_state(path, layout=True) for path in paths}
        layouts = {CheckpointLayout.from_record(s["layout"], p) for p, s in states.items()}
        if len(layouts) != 1:
            raise ValueError(f"{directory}: the ranks' state files disagree on the layout: "
                             f"{sorted(x.flags() for x in layouts)}")
        check_layout(directory, layouts.pop(), len(paths), CheckpointLayout.of_config(config),
                     files=STATE_FILE.format(rank="<r>"))
        versions = {s["version"] for s in states.values()}
        if len(versions) != 1:
            raise ValueError(f"{directory}: the ranks' state files disagree on the version: "
                             f"{sorted(versions)}")
        return versions.pop()

    def load_checkpoint(self, directory: Path, min_version: int = 0) -> int:
        """Restore :meth:`save_checkpoint` output on this rank (every rank calls it): its
        shards of the weights (read from ``model``), its optimizer shard, its RNG state.

        Atomic as :meth:`TorchBackend.load_checkpoint`: everything is read and checked (layout,
        tensor names and shapes, the optimizer state in a probe optimizer) before anything
        changes. The optimizer's hyperparameters stay this run's.

        Raises:
            replayrl.actors.version_clock.VersionRegression: the saved version is below
                ``min_version``.
            replayrl.trainer.backends.checkpoint_layout.CheckpointLayoutError: another backend's
                checkpoint, or one saved with another ``--dp-size``.
            replayrl.rollout.model.CheckpointError / ValueError: unreadable or mismatching files.
        """
        directory = Path(directory)
        refuse_other_backend(directory, "fsdp")
        rank = dist.get_rank()
        path = directory / STATE_FILE.format(rank=rank)
        probe_path = path if path.exists() else directory / STATE_FILE.format(rank=0)
        state = read_trainer_state(probe_path, layout=True)
        check_layout(directory, CheckpointLayout.from_record(state["layout"], probe_path),
                     len(list(directory.glob(STATE_FILE.format(rank="*")))), self.layout(),
                     files=STATE_FILE.format(rank="<r>"))
        version = state["version"]
        check_version(directory, version, min_version)
        weights, current = read_policy(directory, self.config).state_dict(), self.model.state_dict()
        check_weights_fit(directory, weights, current)
        optimizer_state = state["optimizer"]
        # the saved shards as DTensors laid out as the parameters (an index past them is
        # left as it is: the probe below refuses it)
        optimizer_state["state"] = {
            i: {k: like_param(v, self.params[i]) if isinstance(i, int) and i < len(self.params)
                else v for k, v in s.items()}
            for i, s in optimizer_state["state"].items()}
        probe = torch.optim.AdamW(self.params)
        try:
            probe.load_state_dict(optimizer_state)
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
            raise ValueError(f"{probe_path}: optimizer state does not fit this policy: "
                             f"{type(exc).__name__}: {exc}") from None
        # everything checked: swap
        with torch.no_grad():
            for name, t in current.items():
                local_shard(t).copy_(local_shard(shard_like(weights[name], t)))
        self._load_optimizer_keeping_settings(optimizer_state)
        torch.set_rng_state(state["torch_rng"])
        return version


def _arrays(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """CPU float32 tensors -> read-only numpy arrays (no copy)."""
    out = {}
    for name, t in state.items():
        a = t.numpy()
        a.setflags(write=False)
        out[name] = a
    return out


def _decoder_layers(model: Qwen3MoeForCausalLM | FamilyModel) -> torch.nn.ModuleList:
    """The decoder layers of the policy (one FSDP unit each): the embedded model's
    ``model.layers``, or those of the transformers model a family model wraps."""
    return model.hf.model.layers if isinstance(model, FamilyModel) else model.model.layers


def _group_backend() -> str:
    """The device backend of a process group this backend makes itself (as RankGroup)."""
    gpu = torch.cuda.is_available() and dist.is_nccl_available()
    return "cpu:gloo,cuda:nccl" if gpu else "gloo"

