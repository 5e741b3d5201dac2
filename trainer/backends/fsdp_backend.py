"""The FSDP2 trainer backend: the torch backend's policy, sharded over the data-parallel ranks.

:class:`FSDPBackend` (``--train-backend fsdp``) builds the policy exactly as
:class:`replayrl.trainer.backends.torch_backend.TorchBackend` does (``load_pretrained``: the
embedded default or an ``--hf-checkpoint`` of a family the loader reads, transformers' model
of that family included: :class:`replayrl.rollout.model.families.base.FamilyModel`, whose router
and indexer hooks capture and replay inside each sharded decoder layer) and runs the same
forward (:func:`replayrl.trainer.backends.torch_backend.response_logprobs`: routing, indexer and
support replay, prefix tree, fused LM head), but shards every parameter, gradient and AdamW
moment over the trainer ranks with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``): one
FSDP unit per decoder layer plus the root (embedding, final norm, LM head). A rank holds
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
  (:meth:`push_arrays`) and the checkpoint gather them from the shards and are the torch
  backend's (the factors, after the base on a first push; ``model`` + peft's ``adapter``).

Precision: on CUDA with bf16 the FSDP2 mixed-precision policy computes in bf16 (all-gathered
weights cast once per unit) over fp32 master weights, gradients reduced in fp32; on CPU it is
all fp32, as the torch backend. Without a process group (one rank) the backend makes a
world-size-1 group of its own.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from replayrl.actors.errors import VersionRegression
from replayrl.rollout.model.adapters import LORA_A_SUFFIX, LORA_B_SUFFIX
from replayrl.rollout.model.checkpoint import load_state_arrays, save_pretrained
from replayrl.rollout.model.families.base import FamilyConfig, FamilyModel
from replayrl.rollout.model.hf_config import read_hf_config
from replayrl.rollout.model.loader import check_weight_files, load_pretrained
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.trainer.backends.checkpoint_layout import CheckpointLayout, check_layout, refuse_other_backend
from replayrl.trainer.backends.torch_backend import TorchBackend, _check_weights_fit
from replayrl.trainer.batching.batch import TrainBatch
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.lora import peft_adapter as lora
from replayrl.trainer.lora.settings import target_modules

__all__ = ["FSDPBackend", "STATE_FILE"]

STATE_FILE = "fsdp_state.rank{rank}.pt"
"""Per-rank trainer state file of an FSDP checkpoint (optimizer shard, version, RNG, layout)."""


class FSDPBackend(TorchBackend):
    """The torch backend's policy and forward under FSDP2, AdamW on the sharded parameters.

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
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.config = config
        torch.set_num_threads(config.torch_threads)
        torch.manual_seed(config.seed)
        # FSDP2 warns once that a decoder layer returns views (its cache entry, its choices):
        # an in-place op on one would skip the pre-backward hook; the forward does none
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        if not dist.is_initialized():  # one rank: a group of one, in this process
            dist.init_process_group(_group_backend(), store=dist.HashStore(), rank=0,
                                    world_size=1)
        self.device = _device()
        self.model, self._model_config = load_pretrained(checkpoint_dir, dtype=torch.float32)
        self.model.to(self.device)
        self.model.train()
        if config.lora_rank:  # trainer/lora/peft_adapter.py: adapters added before sharding, only they train
            self.lora_config = lora.add_adapters(self.model, config.lora_rank, config.lora_alpha,
                                                 target_modules(config.lora_target_modules),
                                                 config.seed)
            self._adapted = lora.adapted_weights(self.model)
            # the experts are adapted inside each MoE block's forward, on the gathered weights
            lora.hook_experts(self.model)
            self.experts_hooked = True
        bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        # fp32 master weights (the sharded parameters the optimizer updates), bf16 compute
        # where the device has it, gradients reduced in fp32; on CPU everything is fp32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                      reduce_dtype=torch.float32 if bf16 else None)
        self.mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        for layer in _decoder_layers(self.model):
            fully_shard(layer, mesh=self.mesh, mp_policy=policy)
        fully_shard(self.model, mesh=self.mesh, mp_policy=policy)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self._make_optimizer()
        self.vocab_tokens = list(vocab_tokens)
        self.checkpoint_dir = checkpoint_dir
        self.ddp = None  # FSDP reduces the gradients itself

    def _make_optimizer(self) -> torch.optim.AdamW:
        """``torch.optim.AdamW(fused=True)`` over the sharded DTensor parameters: its state dict
        and loading handle DTensors, and this process imports torch.distributed's stack anyway
        (the torch backend's :class:`replayrl.trainer.backends.optimizer.FusedAdamW` saves ``torch._dynamo``
        on the one-process path)."""
        cfg = self.config
        return torch.optim.AdamW(self.params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                 eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=True)

    def _forward(self, batch: TrainBatch, capture: bool, entropy_out: list | None = None,
                 train: bool = False) -> tuple[torch.Tensor, object]:
        """:meth:`TorchBackend._forward` on this backend's device; what it returns is on the
        CPU (the logprobs keep their gradient through the copy)."""
        if self.device.type == "cpu":
            return super()._forward(batch, capture, entropy_out, train)
        moved = dataclasses.replace(batch, **{
            f.name: getattr(batch, f.name).to(self.device) for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)})
        entropy: list = []
        logp, out = super()._forward(moved, capture, entropy, train)
        if entropy_out is not None:
            entropy_out.extend(e.cpu() for e in entropy)
        out = dataclasses.replace(out, **{
            f.name: getattr(out, f.name).cpu() for f in dataclasses.fields(out)
            if f.name not in ("logits", "hidden") and isinstance(getattr(out, f.name), torch.Tensor)})
        return logp.cpu(), out

    def clip_and_step(self, max_norm: float) -> float:
        """See :meth:`TrainerBackend.clip_and_step`: the norm over every rank's gradient shards
        (the same on every rank), AdamW on the shards."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        grad_norm = float(_full(norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm
        self.optimizer.step()
        return grad_norm

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

    def push_arrays(self, full: bool = True) -> dict[str, np.ndarray]:
        """See :meth:`TrainerBackend.push_arrays`: :meth:`weights`, or under LoRA the adapter
        factors gathered from the shards (float32 ``N.lora_A`` [r, in], ``N.lora_B`` [out, r]
        times the scaling), after the base weights when ``full``: the torch backend's LoRA
        bundle (:func:`replayrl.trainer.lora.peft_adapter.adapter_arrays`), merged by the engine. A collective."""
        if not self.lora_config:
            return self.weights()
        base, factors = lora.split_state(self._gathered(), self._adapted)
        return _arrays({**base, **factors} if full else factors)

    def _gathered(self) -> dict[str, torch.Tensor]:
        """Every state-dict tensor all-gathered from the shards (a collective), float32 CPU
        copies under the model's own names (peft's under LoRA)."""
        with torch.no_grad():
            return {name: _full(t).detach().to(device="cpu", dtype=torch.float32, copy=True)
                    for name, t in self.model.state_dict().items()}

    def weight_bundle(self) -> dict:
        """See :meth:`TrainerBackend.weight_bundle` (:meth:`weights` packed; a collective)."""
        from replayrl.transport.array_bundle import pack_arrays

        return pack_arrays(self.weights())

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
        state["state"] = {i: {k: _local(v) for k, v in s.items()}
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
            _read_model(directory, config)
        paths = sorted(directory.glob(STATE_FILE.format(rank="*")))
        if not paths:
            raise ValueError(f"{directory}: no {STATE_FILE.format(rank='<r>')} (an fsdp checkpoint)")
        states = {path: _read_state(path) for path in paths}
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
        state = _read_state(probe_path)
        check_layout(directory, CheckpointLayout.from_record(state["layout"], probe_path),
                     len(list(directory.glob(STATE_FILE.format(rank="*")))), self.layout(),
                     files=STATE_FILE.format(rank="<r>"))
        version = state["version"]
        if version < min_version:
            raise VersionRegression(f"checkpoint {directory} is at version {version}, behind the "
                                    f"trainer's {min_version}; versions never move backwards")
        weights, current = _read_model(directory, self.config).state_dict(), self.model.state_dict()
        _check_weights_fit(directory, weights, current)
        optimizer_state = state["optimizer"]
        # the saved shards as DTensors laid out as the parameters (an index past them is
        # left as it is: the probe below refuses it)
        optimizer_state["state"] = {
            i: {k: _like_param(v, self.params[i]) if isinstance(i, int) and i < len(self.params)
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
                _local(t).copy_(_local(_shard_like(weights[name], t)))
        self._load_optimizer_keeping_settings(optimizer_state)
        torch.set_rng_state(state["torch_rng"])
        return version

    def parameter_count(self) -> int:
        """See :meth:`TrainerBackend.parameter_count` (the full policy's, not this shard's)."""
        return int(sum(p.numel() for p in self.model.parameters()))

    def digest(self) -> dict[str, bytes]:
        """See :meth:`TrainerBackend.digest`: THIS rank's shards (no collective) of every weight
        (``param/<name>``) and AdamW moment (``opt/<i>/<key>``); the shards of ranks
        ``0 .. N-1`` concatenated in rank order are the full tensors' bytes. A buffer in the
        state dict (a DeepSeek / GLM router's ``e_score_correction_bias``) is not sharded:
        every rank gives it whole."""
        arrays = {f"param/{k}": _local(v).detach().cpu().numpy()
                  for k, v in self.model.state_dict().items()}
        for i, st in self.optimizer.state_dict()["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                arrays[f"opt/{i}/{key}"] = _local(st[key]).cpu().numpy()
        return {k: np.ascontiguousarray(v).tobytes() for k, v in arrays.items()}


def _read_model(directory: Path, config: TrainerConfig) -> torch.nn.Module:
    """The policy of a checkpoint's ``model`` (CPU, fp32), under ``config``'s LoRA with the
    adapters of ``directory/adapter`` (:func:`replayrl.trainer.lora.peft_adapter.load_into`); the global RNG
    is left as it was.

    Raises:
        replayrl.rollout.model.CheckpointError: unreadable model files. ValueError: adapters
            that do not fit this run's ``--lora-*`` settings.
    """
    with torch.random.fork_rng(devices=[]):  # building the model draws initial weights
        model, _ = load_pretrained(directory / "model", dtype=torch.float32)
        if config.lora_rank:
            lora.load_into(model, directory / lora.ADAPTER_DIR, config.lora_rank, config.lora_alpha,
                           target_modules(config.lora_target_modules), config.seed)
    return model


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


def _device() -> torch.device:
    """This rank's device: its CUDA device (rank modulo the visible devices) or the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (an all-gather / all-reduce: a collective); a tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t):
    """A DTensor's local shard (no copy); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` cut as ``like`` (a DTensor) is, from this rank's copy (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full.to(like.device)
    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements,
                             src_data_rank=None)


def _like_param(value, param: torch.Tensor):
    """A saved optimizer-state entry (a local shard) as a DTensor laid out as ``param``; a
    scalar (``step``) or an entry of another shape as it is."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(param, DTensor) and isinstance(value, torch.Tensor)
            and value.shape == param.to_local().shape and value.dim() > 0):
        return value
    return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride(), run_check=False)


def _read_state(path: Path) -> dict:
    """One rank's ``fsdp_state.rank<r>.pt`` (``weights_only``: no pickle code runs), checked.

    Raises:
        ValueError: unreadable, or a missing / malformed ``optimizer``, ``version``,
            ``torch_rng`` or ``layout`` (names the file and the field).
    """
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, pickle / zip errors, EOFError...
        raise ValueError(f"{path}: unreadable trainer state: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict) or not {"optimizer", "version", "torch_rng", "layout"} <= set(state):
        raise ValueError(f"{path}: expected the keys optimizer, version, torch_rng, layout")
    version = state["version"]
    if type(version) is not int or version < 0:
        raise ValueError(f"{path}: version must be an int >= 0, got {version!r}")
    rng, reference = state["torch_rng"], torch.get_rng_state()
    if not isinstance(rng, torch.Tensor) or rng.dtype != reference.dtype or rng.shape != reference.shape:
        raise ValueError(f"{path}: torch_rng is not a torch RNG state")
    if not isinstance(state["optimizer"], dict) or "state" not in state["optimizer"]:
        raise ValueError(f"{path}: optimizer is not an optimizer state dict")
    CheckpointLayout.from_record(state["layout"], path)
    return state
