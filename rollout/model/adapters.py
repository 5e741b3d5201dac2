"""LoRA adapter pushes: the low-rank factors of the adapted weights, merged by the engine.

A LoRA run (``--lora-rank``, docs/design/lora.md#lora) pushes the base weights with the adapters
once (the first push, and the push to a restarted engine), then only the adapters: for every
adapted weight ``W`` (HF name ``N``, float [out, in]) the two arrays ``N + LORA_A_SUFFIX``
(float32 [r, in]) and ``N + LORA_B_SUFFIX`` (float32 [out, r], already multiplied by the LoRA
scaling ``alpha / r``), so that the policy's weight is ``W_base + B @ A``; a family model's
fused expert tensor [E, out, in] gets per-expert factors [E, r, in] and [E, out, r] (batched).
:class:`AdapterMerge` keeps, on the engine, the base of every weight an adapter push touched
(copied at the first adapter push after a full one) and writes the merged weight into the
model in place: the engine's forward is unchanged and costs nothing extra (merged, not
applied as adapters at every forward: docs/benchmarks.md#lora).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from replayrl.rollout.model.errors import CheckpointError
from replayrl.rollout.model.families.base import FamilyModel

__all__ = ["LORA_A_SUFFIX", "LORA_B_SUFFIX", "AdapterMerge", "split_adapter_push"]

LORA_A_SUFFIX = ".lora_A"
LORA_B_SUFFIX = ".lora_B"


def split_adapter_push(arrays: Mapping[str, object]) -> tuple[dict, dict]:
    """``(weights, factors)``: a push's full weights and its LoRA factors (keys ending with
    :data:`LORA_A_SUFFIX` / :data:`LORA_B_SUFFIX`). A LoRA run's first push (and the push to a
    restarted engine) holds both: the base weights, then the adapters merged into them; its
    later pushes hold only the factors."""
    factors = {k: v for k, v in arrays.items() if k.endswith((LORA_A_SUFFIX, LORA_B_SUFFIX))}
    return {k: v for k, v in arrays.items() if k not in factors}, factors


class AdapterMerge:
    """The engine's side of adapter pushes: base weights kept, adapters merged into the model.

    :meth:`apply` after a full load (:meth:`reset` called by it) writes ``base + B @ A`` into
    every adapted weight of the model; a weight no adapter push names keeps its full-push value.
    Memory: one copy (engine dtype) of every adapted weight.
    """

    def __init__(self) -> None:
        self._base: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """A full weight set was loaded: it is the new base."""
        self._base.clear()

    def apply(self, model: torch.nn.Module, arrays: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """Merge an adapter push into ``model`` (in place, cast to the model's dtype).

        Args:
            model: the engine's model: the embedded Qwen3-MoE or a family model (weights
                under their HF names either way).
            arrays: ``N.lora_A`` float [r, in] and ``N.lora_B`` float [out, r] (scaled) per
                adapted weight ``N``; for a family's fused expert tensor [E, out, in] the
                per-expert factors [E, r, in] and [E, out, r] (``W[e] += B[e] @ A[e]``).

        Raises:
            CheckpointError: an unpaired factor, a name that is no weight of the model, or factor
                shapes whose product is not the weight's shape (named); checked before anything
                changes.
        """
        # HF names: a family model (rollout/model/families/) wraps transformers' model as ``hf``
        params = dict((model.hf if isinstance(model, FamilyModel) else model).named_parameters())
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key in arrays:
            if not key.endswith(LORA_A_SUFFIX):
                continue
            name = key[:-len(LORA_A_SUFFIX)]
            if name + LORA_B_SUFFIX not in arrays:
                raise CheckpointError(f"adapter push: {key!r} has no {name + LORA_B_SUFFIX!r}")
            a, b = (torch.tensor(np.asarray(arrays[name + s]), dtype=torch.float32)
                    for s in (LORA_A_SUFFIX, LORA_B_SUFFIX))
            if name not in params:
                raise CheckpointError(f"adapter push: {name!r} is no weight of the model")
            want = tuple(params[name].shape)
            if (a.ndim != b.ndim or a.ndim not in (2, 3) or a.shape[:-2] != b.shape[:-2]
                    or a.shape[-2] != b.shape[-1] or (*b.shape[:-1], a.shape[-1]) != want):
                raise CheckpointError(f"adapter push: {name!r} factors B {list(b.shape)} @ A "
                                      f"{list(a.shape)} do not give the weight's shape {list(want)}")
            pairs[name] = (a, b)
        unpaired = [k for k in arrays if k.endswith(LORA_B_SUFFIX) and k[:-len(LORA_B_SUFFIX)] not in pairs]
        if unpaired:
            raise CheckpointError(f"adapter push: {unpaired[0]!r} has no matching lora_A")
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                p = params[name]
                base = self._base.setdefault(name, p.detach().clone())
                p.copy_(base.float() + (b @ a).to(p.device))  # factors arrive on the CPU
