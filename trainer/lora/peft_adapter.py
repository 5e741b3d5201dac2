"""LoRA on the policy through peft (``--lora-rank``; docs/design/lora.md#lora): the embedded
Qwen3-MoE or a family's transformers model, on the torch and fsdp backends.

:func:`add_adapters` injects peft LoRA layers (``peft.inject_adapter_in_model``, a
``peft.LoraConfig``) into the policy and freezes every base weight: only the adapters train
and sit in the optimizer. The targets are module names (``--lora-target-modules``); the
expert projections ``gate_proj`` / ``up_proj`` / ``down_proj`` of every expert are adapted with
the dense ones, one adapter per expert (the Hub's per-expert Qwen3-MoE layout, which peft
converts to transformers' fused expert tensors when it loads the adapter). The router
``gate`` is adapted only when named.

On a family model (rollout/model/families/) the names resolve per family
(:func:`replayrl.trainer.lora.settings.family_targets`; the default ``all``: every attention and
MLP projection the family has) and the fused expert tensors are peft ``target_parameters`` (a
``ParamWrapper`` applied in the experts' forward); the names below are then the HF names of
transformers' model (:func:`_root`), and the push carries per-expert factors.

The embedded MoE block reads its experts' weights (``experts.{e}.gate_proj.weight``) to stack them for
one grouped matmul instead of calling the expert modules, so peft's ``lora.Linear.forward``
never runs there: :func:`experts_adapted` wraps a forward and parametrizes each adapted
expert weight as ``W + scaling * B @ A`` (``torch.nn.utils.parametrize``, the mechanism of
peft's own ``ParamWrapper``), differentiable into ``A`` and ``B``. Every other adapted module
(attention, dense MLP, router) is called and goes through peft's forward.

Names: the base weights keep their HF names (:func:`base_state` strips peft's
``.base_layer``); the adapter file is peft's (``adapter_config.json`` +
``adapter_model.safetensors``, keys ``base_model.model.<module>.lora_{A,B}.weight``), loaded
by ``peft.PeftModel.from_pretrained`` on the HF checkpoint of the base. peft is the optional
extra ``lora``, imported only by a LoRA run.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
from torch.nn.utils import parametrize

from replayrl.rollout.model.adapters import LORA_A_SUFFIX, LORA_B_SUFFIX
from replayrl.rollout.model.families.base import FamilyModel
from replayrl.trainer.errors import TrainerConfigError
from replayrl.trainer.lora.settings import family_targets

__all__ = ["ADAPTER_DIR", "add_adapters", "adapter_arrays", "adapter_parameters", "head_weight",
           "base_state", "experts_adapted", "hook_experts", "load_adapters", "load_into", "merged_state",
           "save_adapters", "adapted_weights", "split_state"]

ADAPTER_NAME = "default"
ADAPTER_DIR = "adapter"
"""Checkpoint subdirectory of the peft adapter (beside ``model``, the base). The
``--lora-target-modules`` names and their check: :mod:`replayrl.trainer.lora.settings` (no torch)."""


def _peft():
    try:
        import peft
    except ImportError as exc:  # the optional extra
        raise TrainerConfigError("--lora-rank needs peft: pip install -e '.[lora]'") from exc
    return peft


def _family(model: torch.nn.Module) -> str:
    """The policy's family (HF ``model_type``), ``""`` for the embedded model."""
    return model.config.family if isinstance(model, FamilyModel) else ""


def _lora_config(rank: int, alpha: float, targets: tuple[str, ...], family: str):
    """The ``peft.LoraConfig`` of ``--lora-target-modules`` ``targets`` on a ``family`` policy
    (:func:`replayrl.trainer.lora.settings.family_targets`: the modules, and a family's fused
    expert tensors as ``target_parameters``; peft matches a listed module name as the end of
    the module's name, so ``gate`` names only the router, never ``gate_proj``)."""
    modules, parameters = family_targets(targets, family)
    return _peft().LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(modules),
                              target_parameters=list(parameters) or None, lora_dropout=0.0, bias="none")


def add_adapters(model: torch.nn.Module, rank: int, alpha: float, targets: tuple[str, ...],
                 seed: int) -> object:
    """Inject LoRA adapters (peft's init: ``A`` Kaiming-uniform drawn with ``seed``, ``B`` zero,
    so the policy is unchanged) and freeze every other parameter. Returns the ``LoraConfig``.

    Raises:
        TrainerConfigError: peft missing, or no module of the model matches ``targets``.
    """
    if isinstance(model, FamilyModel) and "gate" in targets:
        raise TrainerConfigError(f"--lora-target-modules gate: the {model.config.family!r} family's "
                                 f"router (mlp.gate) is transformers' own top-k module, not an "
                                 f"nn.Linear; peft cannot adapt it")
    config = _lora_config(rank, alpha, targets, _family(model))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            _peft().inject_adapter_in_model(config, _root(model), adapter_name=ADAPTER_NAME)
        except ValueError as exc:
            raise TrainerConfigError(f"--lora-target-modules {','.join(targets)}: {exc}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return config


def head_weight(head: torch.nn.Module) -> torch.Tensor:
    """The weight an LM head multiplies by, float [V, H]: ``W + scaling * B @ A`` when
    ``--lora-target-modules`` adapts it (a peft ``lora.Linear``, whose ``.weight`` is the base
    weight alone), else its ``.weight``. For the fused support-replay path, which reads the head's
    weight instead of calling the module; differentiable into ``A`` and ``B``."""
    base = getattr(head, "base_layer", None)
    if base is None:
        return head.weight
    return base.weight + head.get_delta_weight(ADAPTER_NAME).to(base.weight.dtype)


def adapter_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The adapters' parameters (``lora_A`` / ``lora_B`` of every adapted module), model order."""
    return [p for name, p in model.named_parameters() if ".lora_" in name]


def _root(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose names are the HF names: a family model's transformers model
    (:class:`replayrl.rollout.model.families.base.FamilyModel` wraps it as ``hf``), else the model."""
    return model.hf if isinstance(model, FamilyModel) else model


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(HF module name, peft ``LoraLayer``) of every adapted module."""
    from peft.tuners.lora import LoraLayer

    for name, module in _root(model).named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


class _Delta(torch.nn.Module):
    """Parametrization ``W -> W + scaling * B @ A`` of one peft ``lora.Linear``'s base weight."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = [layer]  # not a submodule: the parametrization must not own it

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] -> the adapted weight, same shape and dtype."""
        return weight + self.layer[0].get_delta_weight(ADAPTER_NAME).to(weight.dtype)


@contextlib.contextmanager
def experts_adapted(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every adapted expert weight reads as ``W + scaling * B @ A``
    (gradients reach ``A`` and ``B``); outside it the weight is the base again. A no-op for a
    model without adapted experts. The graph built inside stays valid for a later backward."""
    experts = [m for name, m in _lora_layers(model) if ".experts." in name and not _is_param_wrapper(m)]
    done = []
    try:
        for layer in experts:
            parametrize.register_parametrization(layer.base_layer, "weight", _Delta(layer), unsafe=True)
            done.append(layer)
        yield
    finally:
        for layer in done:
            parametrize.remove_parametrizations(layer.base_layer, "weight", leave_parametrized=False)


def hook_experts(model: torch.nn.Module) -> list:
    """:func:`experts_adapted` per MoE block, for good: a forward pre-hook on every block whose
    ``experts`` hold adapters parametrizes them (``W + scaling * B @ A``) and a forward hook
    removes the parametrizations again, so each block's forward reads its adapted expert
    weights and nothing else ever sees them. Under FSDP2 (the fsdp backend) this runs inside the
    decoder layer's unsharded window, on the all-gathered weights: :func:`experts_adapted`
    around the whole forward would parametrize the sharded ones. A forward that raised leaves
    nothing behind either: the next pre-hook removes what is left first. Returns the hook
    handles (``handle.remove()`` undoes them)."""
    blocks: dict[str, list[torch.nn.Module]] = {}
    for name, layer in _lora_layers(model):
        if ".experts." in name and not _is_param_wrapper(layer):
            blocks.setdefault(name.split(".experts.")[0], []).append(layer)
    modules = dict(_root(model).named_modules())
    handles = []

    def _remove(layers):
        for layer in layers:
            if parametrize.is_parametrized(layer.base_layer, "weight"):
                parametrize.remove_parametrizations(layer.base_layer, "weight", leave_parametrized=False)

    def _pre(layers):
        def hook(module, args):
            _remove(layers)
            for layer in layers:
                parametrize.register_parametrization(layer.base_layer, "weight", _Delta(layer), unsafe=True)
        return hook

    for block, layers in blocks.items():
        handles.append(modules[block].register_forward_pre_hook(_pre(layers)))
        handles.append(modules[block].register_forward_hook(lambda m, a, o, layers=layers: _remove(layers)))
    return handles


def adapted_weights(model: torch.nn.Module) -> dict[str, tuple[str, torch.nn.Module]]:
    """Every adapted weight: HF weight name ``N`` -> (the state-dict prefix of its adapter's
    ``lora_A`` / ``lora_B``, the peft layer). ``N`` is ``<module>.weight`` for a peft
    ``lora.Linear``, ``<module>.<parameter>`` for a ``ParamWrapper`` (a fused expert tensor
    [E, out, in] of a family model, adapted through peft's ``target_parameters``)."""
    out = {}
    for name, layer in _lora_layers(model):
        param = layer.parameter_name if _is_param_wrapper(layer) else "weight"
        out[f"{name.replace('.base_layer', '')}.{param}"] = (name, layer)
    return out


def split_state(state: dict[str, torch.Tensor], adapted: dict[str, tuple[str, torch.nn.Module]]
                ) -> tuple[dict, dict]:
    """``(base, factors)`` of a LoRA policy's full state dict (peft's names, e.g. gathered from
    FSDP2 shards): ``base`` the base weights under HF names (as :func:`base_state`), ``factors``
    the push's factors ``N.lora_A`` / ``N.lora_B`` (:func:`adapter_arrays`) of every weight
    ``N`` of ``adapted`` (:func:`adapted_weights`). The tensors of ``base`` are those of
    ``state``; the factors new ones."""
    base = {name.replace(".base_layer", ""): t for name, t in state.items() if ".lora_" not in name}
    factors = {}
    for name, (prefix, layer) in adapted.items():
        a, b = _push_factors(layer, state[f"{prefix}.lora_A.{ADAPTER_NAME}.weight"].detach(),
                             state[f"{prefix}.lora_B.{ADAPTER_NAME}.weight"].detach())
        factors[name + LORA_A_SUFFIX], factors[name + LORA_B_SUFFIX] = a.clone(), b
    return base, factors


def _is_param_wrapper(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is peft's ``ParamWrapper`` (an adapted parameter, not an nn.Linear)."""
    from peft.tuners.lora.layer import ParamWrapper

    return isinstance(layer, ParamWrapper)


def _push_factors(layer: torch.nn.Module, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A peft layer's ``lora_A`` / ``lora_B`` weights (``a``, ``b``) -> the push's ``(A, B)``
    with ``weight + B @ A`` the adapted weight: for a ``lora.Linear`` ``a`` [r, in] and ``b``
    times the scaling [out, r]; for a ``ParamWrapper`` of a fused expert tensor [E, ., .] the
    per-expert factors of peft's ``get_delta_factors`` (batched: [E, out, r] @ [E, r, in],
    transposed for a tensor stored [E, in, out]), the left one times the scaling."""
    scaling = float(layer.scaling[ADAPTER_NAME])
    if not _is_param_wrapper(layer) or layer.num_experts == 1:
        return a, b * scaling
    e = layer.num_experts
    a = a.reshape(e, -1, a.shape[-1])  # [E, r, in]
    b = b.reshape(b.shape[0], -1, e).permute(2, 0, 1)  # [E, out, r]
    if layer._did_swap_in_out_features:  # the tensor is [E, out, in]
        return a, b * scaling
    return b.transpose(-2, -1), a.transpose(-2, -1) * scaling  # [E, in, out] = A^T-side first


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights under their HF names (peft's ``.base_layer`` removed, adapters left
    out); the tensors are the model's own (no copy)."""
    return {name.replace(".base_layer", ""): t for name, t in model.state_dict().items()
            if ".lora_" not in name}


def _factors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF weight name, A, B) of every adapted weight, ``W + B @ A`` the adapted one
    (:func:`_push_factors`: A [r, in], B [out, r] times the scaling; batched per expert for a
    fused expert tensor)."""
    for name, (_, layer) in adapted_weights(model).items():
        yield (name, *_push_factors(layer, layer.lora_A[ADAPTER_NAME].weight.detach().float(),
                                    layer.lora_B[ADAPTER_NAME].weight.detach().float()))


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy as plain weights: :func:`base_state` with ``scaling * B @ A`` added to every
    adapted weight (new float tensors for those, the model's own for the rest)."""
    state = dict(base_state(model))
    with torch.no_grad():
        for name, a, b in _factors(model):
            state[name] = state[name] + b @ a
    return state


def adapter_arrays(model: torch.nn.Module) -> dict:
    """The adapter push (:mod:`replayrl.rollout.model.adapters`): float32 numpy ``N.lora_A``
    [r, in] and ``N.lora_B`` [out, r] (times the scaling) per adapted weight ``N`` ([E, r, in]
    and [E, out, r] for a fused expert tensor [E, out, in]); copies."""
    return {name: t.to("cpu", copy=True).numpy() for name, t in adapter_tensors(model).items()}


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`adapter_arrays` as float32 tensors on the model's device (new tensors)."""
    out = {}
    with torch.no_grad():
        for name, a, b in _factors(model):
            out[name + LORA_A_SUFFIX] = a.clone()
            out[name + LORA_B_SUFFIX] = b
    return out


def _peft_keys(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors under peft's file keys (``base_model.model.<module>.lora_A.weight``)."""
    return {"base_model.model." + name.replace(f".{ADAPTER_NAME}.", "."): t
            for name, t in model.state_dict().items() if ".lora_" in name}


def save_adapters(model: torch.nn.Module, config, directory: Path, base_dir: str = "",
                  state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write peft's adapter files (``adapter_config.json``, ``adapter_model.safetensors``) of
    ``model`` to ``directory``; ``base_dir`` is recorded as the base model's path. ``state``:
    the model's state dict with full tensors (the fsdp backend's, gathered from the shards);
    None: ``model.state_dict()``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.base_model_name_or_path = base_dir
    config.save_pretrained(str(directory))
    keys = {"base_model.model." + name.replace(f".{ADAPTER_NAME}.", "."): t
            for name, t in state.items() if ".lora_" in name} if state is not None else _peft_keys(model)
    save_file({k: t.detach().contiguous() for k, t in keys.items()},
              str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return directory


def load_into(model: torch.nn.Module, directory: Path, rank: int, alpha: float,
              targets: tuple[str, ...], seed: int) -> torch.nn.Module:
    """A plain policy read from a LoRA checkpoint's ``model`` -> the LoRA policy: adapters
    added (:func:`add_adapters`) and set to :func:`save_adapters` output in ``directory``
    (checked by :func:`load_adapters`). Returns ``model`` (changed in place).

    Raises:
        TrainerConfigError / ValueError: as :func:`add_adapters` / :func:`load_adapters`.
    """
    add_adapters(model, rank, alpha, targets, seed)
    model.load_state_dict(load_adapters(model, directory, rank, alpha, targets), strict=False)
    return model


def load_adapters(model: torch.nn.Module, directory: Path, rank: int, alpha: float,
                  targets: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Read :func:`save_adapters` output and check it against ``model``'s adapters and this
    run's settings; returns the tensors under the model's state-dict names, changes nothing.

    Raises:
        ValueError: missing / unreadable files, another rank, alpha or target list than this
            run's, or tensors whose names or shapes differ (named).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    try:
        saved = json.loads((directory / "adapter_config.json").read_text())
        tensors = load_file(str(directory / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory}: unreadable LoRA adapter: {type(exc).__name__}: {exc}") from None
    # this run's settings as peft applied them to this model (family_targets: on a family the
    # fused experts are target_parameters)
    want = ((getattr(_root(model), "peft_config", None) or {}).get(ADAPTER_NAME)
            or _lora_config(rank, alpha, targets, _family(model)))
    for key in ("r", "lora_alpha", "target_modules", "target_parameters"):
        norm = (lambda v: sorted(v) if isinstance(v, (list, set, tuple)) else v)
        if norm(saved.get(key)) != norm(getattr(want, key)):
            raise ValueError(f"{directory}/adapter_config.json: {key} {saved.get(key)!r}, this run "
                             f"{getattr(want, key)!r} (--lora-rank / --lora-alpha / --lora-target-modules)")
    current = {"base_model.model." + n.replace(f".{ADAPTER_NAME}.", "."): n
               for n in model.state_dict() if ".lora_" in n}
    if set(tensors) != set(current):
        missing, extra = sorted(set(current) - set(tensors)), sorted(set(tensors) - set(current))
        raise ValueError(f"{directory}: adapter tensors do not match this policy (missing "
                         f"{missing[:4]}, unexpected {extra[:4]})")
    state = model.state_dict()
    for key, name in current.items():
        if tensors[key].shape != state[name].shape:
            raise ValueError(f"{directory}: {key} has shape {tuple(tensors[key].shape)}, this "
                             f"policy {tuple(state[name].shape)}")
    return {current[k]: t for k, t in tensors.items()}
