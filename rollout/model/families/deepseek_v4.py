"""DeepSeek-V4 (`deepseek_v4`, transformers' `DeepseekV4ForCausalLM`).

Three attention layer types: sliding window; compressed sparse attention (CSA: the keys
compressed `compress_rates["compressed_sparse_attention"]`:1 into entries, and the lightning
indexer keeps `index_topk` compressed entries per query); heavily compressed attention (HCA:
dense over its compressed entries, no indexer). MoE on every layer: "moe" layers pick the top-k
experts by `scoring_func` scores (sqrt-softplus by default) plus `e_score_correction_bias`, no
groups; "hash_moe" layers route by a frozen table of the token id (`gate.tid2eid[input_ids]`);
hyper-connections mix `hc_mult` residual streams.

What is traced and replayed:

* routing: the top-k "moe" layers only. A hash-routed layer's choice is a function of the token
  alone, so it stores no trace; instead the engine checks every weight push before loading it:
  its tables will equal the pushed (trainer's) ones (:meth:`DeepseekV4FamilyModel.check_pushed`),
  so engine and trainer hash the same way.
* indexer: the CSA layers' picks, as compressed-entry ids relative to the sequence (entry `w`
  compresses the row's tokens `[m*w, m*(w+1))`, overlapping the window before); a query at
  position `t` may see the entries `w < (t+1) // m`, the others are written -1. A replayed entry
  must be one the query may see; -1 selects nothing and a row of only -1 keeps the indexer's
  own choice (transformers' compressor drops -1 ids itself).

The compression windows start at slot 0 of each row, so a row's real tokens must start at slot
0 (no left padding, no packing) with positions equal to slots: the forward refuses anything else,
and the embedded engine decodes prompts of different lengths in separate same-length batches
(:attr:`DeepseekV4FamilyModel.aligned_rows`).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from replayrl.rollout.model.errors import CheckpointError, ModelConfigError, ModelInputError
from replayrl.rollout.model.families.base import FamilyModel, FamilySpec, _pad_to


def score_router_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor
                         ) -> torch.Tensor:
    """DeepSeek-V4 routing weights of `experts` (int64 `[N, K]`) from router logits `[N, E]`:
    the router's scores (`router.score_fn`, `scoring_func`: sqrt(softplus) by default) gathered
    (no bias: the correction only ranks), divided by their sum (+1e-20: transformers always
    renormalises, whatever `norm_topk_prob` says), times `router.routed_scaling_factor`;
    `[N, K]` in the logits' dtype. As transformers' `DeepseekV4TopKRouter.forward`."""
    w = router.score_fn(logits).gather(1, experts)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


class DeepseekV4FamilyModel(FamilyModel):
    """:class:`FamilyModel` for `deepseek_v4`: routers of the top-k MoE layers and the CSA
    layers' indexers (`self_attn.compressor.indexer`) hooked; hash-routed layers checked, not
    traced. Same forward signature and trace shapes; the indexer trace holds compressed-entry
    ids (int32 `[B, S, L_idx, index_topk]`, -1 = none)."""

    aligned_rows = True
    """A row's real tokens must start at slot 0: the embedded engine batches only prompts of
    equal length (no left padding)."""

    @staticmethod
    def router_of(layer: nn.Module, spec: FamilySpec) -> nn.Module | None:
        """The top-k router (`mlp.gate`) of `layer`; None for a hash-routed layer."""
        if getattr(layer.mlp, "is_hash", False):
            return None
        return FamilyModel.router_of(layer, spec)

    @staticmethod
    def indexer_of(layer: nn.Module) -> nn.Module | None:
        """The lightning indexer of a CSA layer (`self_attn.compressor.indexer`), else None."""
        return getattr(getattr(layer.self_attn, "compressor", None), "indexer", None)

    @staticmethod
    def check_hf_dict(d: dict[str, Any]) -> None:
        """Refuse what transformers' model does not reproduce or replay cannot follow.

        Raises:
            ModelConfigError: naming the field: `num_nextn_predict_layers` > 0 (the
                multi-token-prediction layers are not built: trained weights would be lost),
                `expert_dtype` (quantized experts), a nonzero `attention_dropout` (the trainer's
                attention would be random), `output_router_logits` (an auxiliary loss the
                trainer does not add).
        """
        refused = {
            "num_nextn_predict_layers": (d.get("num_nextn_predict_layers", 1) or 0) != 0,
            "expert_dtype": d.get("expert_dtype") is not None,
            "attention_dropout": (d.get("attention_dropout") or 0.0) != 0.0,
            "output_router_logits": bool(d.get("output_router_logits")),
        }
        for name, bad in refused.items():
            if bad:
                raise ModelConfigError(
                    f"config.json field {name!r}={d.get(name, 1)!r} is not supported for model_type "
                    f"'deepseek_v4' (multi-token-prediction layers, quantized experts, attention "
                    f"dropout and router auxiliary losses are not reproduced)")

    # --- hash-routed layers -------------------------------------------------------------
    def hash_tables(self) -> dict[str, torch.Tensor]:
        """State-dict name -> the `tid2eid` table (int64 `[vocab, K]`) of every hash-routed
        layer."""
        return {name: t for name, t in self.hf.state_dict().items() if name.endswith(".tid2eid")}

    def check_pushed(self, arrays: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """Before a weight push is loaded: every hash-routed layer's table, as the engine
        would hold it (cast to the table's int64), equals the pushed one (the trainer's)
        element for element and names experts in `[0, n_routed_experts)`. A name the push
        lacks is left to the push's own key check.

        Raises:
            CheckpointError: naming the layer's table, when a pushed value would not survive
                the cast (engine and trainer would hash differently) or is no expert id.
        """
        experts = self.config.num_experts
        for name, table in self.hash_tables().items():
            if name not in arrays:
                continue
            pushed = torch.as_tensor(np.array(arrays[name], dtype=np.float64))  # a copy: pushes are read-only
            held = pushed.to(table.dtype).to(torch.float64)
            if not torch.equal(held, pushed):
                row = int((held != pushed).any(-1).nonzero()[0, 0])
                raise CheckpointError(
                    f"weight push: {name!r}: the engine would hash token {row} to experts "
                    f"{held[row].long().tolist()}, the trainer hashes it to {pushed[row].tolist()}")
            if int(held.min()) < 0 or int(held.max()) >= experts:
                raise CheckpointError(f"weight push: {name!r} holds expert ids outside "
                                      f"[0, {experts}): [{int(held.min())}, {int(held.max())}]")

    # --- indexer ------------------------------------------------------------------------
    def _hook_indexer(self, indexer: nn.Module, layer: int) -> None:
        """Replace `indexer.forward` (global layer `layer`) by capture / replay around it.
        transformers' indexer returns entry ids `[B, S, min(index_topk, entries)]`, -1 where
        a query may not see the entry; its compressor attends the ids >= 0."""
        original = indexer.forward
        state = self._state
        k, rate = self.config.index_topk, indexer.compress_rate

        def forward(hidden_states, q_residual, position_ids, cache, layer_idx):
            raw = original(hidden_states, q_residual, position_ids, cache, layer_idx).long()
            raw = _pad_to(raw, k)
            visible = ((position_ids + 1) // rate)[:, :, None]              # [B, S, 1]
            own = torch.where(state.query_real[:, :, None] & (raw >= 0), raw, -1)
            used, feed = own, raw
            replay = (state.slots or {}).get(layer)
            if replay is not None:
                replay = replay.to(raw.device).long()
                bad = (replay >= visible) & state.query_real[:, :, None]
                if bool(bad.any()):
                    b, i, _ = torch.nonzero(bad)[0].tolist()
                    raise ModelInputError(
                        f"indexer_topk replays a compressed entry query {i} of batch row {b} "
                        f"cannot see yet for layer {layer} (it sees {int(visible[b, i, 0])}): "
                        f"{replay[b, i].tolist()}")
                keep_own = (replay < 0).all(-1, keepdim=True)
                used = torch.where(keep_own, own, replay)
                feed = torch.where(keep_own, raw, replay)
            if state.capture:
                state.used_slots[layer] = used
                state.own_slots[layer] = own
            return feed

        indexer.forward = forward

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                key_padding_mask: torch.Tensor | None = None, kv_cache=None, **kwargs):
        """:meth:`FamilyModel.forward`, after checking the row layout the compression windows
        need. Raises `ModelInputError` naming `key_padding_mask` for a real key after a
        padding key in a row (left padding, packing), or `position_ids` for a real query whose
        position is not its slot in the row."""
        if key_padding_mask is not None and key_padding_mask.dim() == 2 and key_padding_mask.shape[1] > 1:
            late = key_padding_mask[:, 1:] & ~key_padding_mask[:, :-1]
            if bool(late.any()):
                row = int(late.any(-1).nonzero()[0, 0])
                raise ModelInputError(
                    f"key_padding_mask: row {row} has a real key after a padding key (left "
                    f"padding or packed rows); the 'deepseek_v4' compression windows start at "
                    f"slot 0 of each row, so pad on the right only")
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2:
            past = kv_cache.length if kv_cache is not None else 0
            slots = torch.arange(past, past + position_ids.shape[1], device=position_ids.device)
            real = (key_padding_mask[:, past:] if key_padding_mask is not None
                    and tuple(key_padding_mask.shape) == (position_ids.shape[0], past + position_ids.shape[1])
                    else torch.ones_like(position_ids, dtype=torch.bool))
            off = real & (position_ids != slots)
            if bool(off.any()):
                row, col = torch.nonzero(off)[0].tolist()
                raise ModelInputError(
                    f"position_ids: row {row} slot {past + col} holds position "
                    f"{int(position_ids[row, col])}; 'deepseek_v4' needs each real token's "
                    f"position equal to its slot in the row")
        return super().forward(input_ids, position_ids, key_padding_mask=key_padding_mask,
                               kv_cache=kv_cache, **kwargs)


FAMILY = FamilySpec(model_type="deepseek_v4", router_attr="gate",
                    router_weights=score_router_weights, has_indexer=False,
                    model_class=DeepseekV4FamilyModel)
