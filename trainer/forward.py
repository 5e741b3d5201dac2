"""One trainer forward: per-response-token logprobs of a :class:`TrainBatch`, with replays.

Which forwards use what (documented choice, DESIGN.md "Trainer math"):
- the proximal (preflight) forward and the policy (training) forward both replay routing and
  indexer traces and normalise over the captured support, so ``logp_prox - logp_rollout``
  measures only numerics, not a different distribution;
- a reference / KL forward (not used by the default GRPO loss) would use the full vocabulary,
  because a KL to a reference policy is defined over the model's own distribution.
"""
from __future__ import annotations

import torch

from rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from trainer.batch import TrainBatch
from trainer.logprobs import full_vocab_logprobs, fused_support_logprobs, support_logprobs


def response_logprobs(model: Qwen3MoeForCausalLM, batch: TrainBatch, temperature: float,
                      *, replay_routing: bool = True, replay_indexer: bool = True,
                      capture: bool = False, chunk_size: int = 0) -> tuple[torch.Tensor, object]:
    """Logprobs of every response token of ``batch`` (float32 [N]) and the model output.

    Support replay is used when ``batch.support`` is set, else the full-vocabulary logprob.
    With ``chunk_size > 0`` (``--logprobs-chunk-size``) and a support, the fused path projects
    only the candidate tokens from the hidden states, ``chunk_size`` rows at a time, and the
    [B, S, V] logits are never computed. The batch's routing / indexer traces are replayed when
    present and enabled.
    """
    fused = chunk_size > 0 and batch.support is not None
    out = model(batch.tokens, batch.position_ids, key_padding_mask=batch.key_padding_mask,
                routed_experts=batch.routed_experts if replay_routing else None,
                indexer_topk=batch.indexer_topk if replay_indexer else None,
                capture=capture, return_hidden=fused, compute_logits=not fused,
                segment_ids=batch.segment_ids)
    if fused:
        hidden = out.hidden[batch.row, batch.pos]
        return fused_support_logprobs(hidden, model.lm_head.weight, batch.support, temperature,
                                      chunk_size), out
    logits = out.logits[batch.row, batch.pos].float()
    if batch.support is not None:
        return support_logprobs(logits, batch.support, temperature), out
    return full_vocab_logprobs(logits, batch.targets, temperature), out
