"""Pipeline-parallel forwards of the megatron backend: megatron-core's schedule, results to every stage.

With ``--pp-size N > 1`` (docs/design/megatron.md#pipeline-parallel)
every trainer rank holds one pipeline stage of the ``GPTModel`` (contiguous, equal layer
ranges; the first stage the embedding, the last the final norm and LM head). A forward then is
megatron-core's own pipeline schedule (``get_forward_backward_func``: 1F1B without
interleaving), not a plain module call: activations travel stage to stage by megatron's p2p
communication, the logits exist only on the last stage, and a training pass runs its backward
inside the schedule. This module holds what the backend needs around it:

* :func:`run_schedule`: one trainer microbatch as one pipeline microbatch through the
  schedule (``forward_only`` for the preflight / proximal passes); the last stage turns the
  logits into logprobs and, when training, into the caller's loss;
* :func:`broadcast_from_last_stage`: the logprobs from the last stage to every stage (the
  trainer leader, world rank 0, is on stage 0 and computes the metrics and the RS decisions);
* :func:`gather_stage_choices`: each stage's captured routing / indexer choices (only its own
  layers' columns) assembled into the full ``[B, S, L, K]`` in global layer order for the flip
  metrics.

One pipeline microbatch per call keeps megatron's ``RouterReplay`` exact: each router holds
one replay target per forward, and with a single microbatch in flight each router runs that
forward once (several microbatches in one schedule call would need one target per microbatch).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["run_schedule", "broadcast_from_last_stage", "gather_stage_choices"]


def run_schedule(model, tokens: torch.Tensor, positions: torch.Tensor,
                 logprobs_of: Callable[[torch.Tensor], torch.Tensor],
                 loss_fn: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor | None:
    """One microbatch through megatron-core's pipeline schedule on this stage.

    Every rank of the pipeline group calls it with the same shapes (a collective: the stages
    exchange activations and their gradients).

    Args:
        model: this stage's (DDP-wrapped) ``GPTModel``.
        tokens: int64 ``[B, S]`` token ids (read by the first stage only); ``S`` a multiple of
            the tensor-parallel size under sequence parallelism.
        positions: int64 ``[B, S]`` RoPE positions.
        logprobs_of: on the last stage, float32 ``[N]`` logprobs from the logits
            ``[B, S, V / tp]``.
        loss_fn: scalar loss of those logprobs, whose gradients the schedule back-propagates
            through every stage; None for a forward-only pass.

    Returns:
        the logprobs (float32 ``[N]``, detached) on the last stage; None on the others.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out: list[torch.Tensor] = []

    def loss_func(logits: torch.Tensor):
        logp = logprobs_of(logits)
        out.append(logp.detach())
        loss = loss_fn(logp) if loss_fn is not None else logp.sum() * 0.0
        # the schedule divides the loss by the number of microbatches (1 here) in place
        return loss.reshape(()).clone(), {}

    def forward_step(data_iterator, stage_model):
        data_tokens, data_positions = next(data_iterator)
        return stage_model(data_tokens, data_positions, attention_mask=None), loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([(tokens, positions)]), model=[model],
        num_microbatches=1, seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
        forward_only=loss_fn is None)
    return out[0] if out else None


def broadcast_from_last_stage(logp: torch.Tensor | None, count: int) -> torch.Tensor:
    """The last stage's logprobs on every stage of this rank's pipeline group.

    Args:
        logp: float32 ``[count]`` on the last stage, None elsewhere.
        count: the number of logprobs (the microbatch's response tokens, known everywhere).

    Returns:
        float32 ``[count]`` (detached).

    Raises:
        ValueError: the last stage's logprobs are missing or not ``[count]``.
    """
    from megatron.core import parallel_state as ps

    if ps.is_pipeline_last_stage():
        if logp is None or tuple(logp.shape) != (count,):
            raise ValueError(f"last pipeline stage: logprobs {None if logp is None else tuple(logp.shape)} "
                             f"!= [{count}]")
        buf = logp.detach().float().contiguous()
    else:
        buf = torch.empty(count, dtype=torch.float32)
    dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    return buf


def gather_stage_choices(layers: Sequence[int], trace_layers: Sequence[int],
                         pair: tuple[torch.Tensor, torch.Tensor] | None):
    """The (used, own) choices of every pipeline stage, in global layer order.

    A collective over the pipeline group (``all_gather_object``: stages may hold different
    numbers of replayed layers, and some none).

    Args:
        layers: global ids of this stage's replayed layers (the ``L_local`` axis of ``pair``).
        trace_layers: every layer with a trace column (``ModelConfig.moe_layers`` or
            ``indexed_layers``), the ``L`` axis of the result.
        pair: ``(used, own)``, int32 ``[B, S, L_local, K]`` each, or None when this stage has
            none of ``trace_layers``.

    Returns:
        ``(used, own)``, int32 ``[B, S, L, K]`` each.

    Raises:
        ValueError: a layer of ``trace_layers`` that no stage captured, or one captured twice.
    """
    from megatron.core import parallel_state as ps

    mine = None if pair is None else (list(layers), pair[0], pair[1])
    parts: list = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, mine, group=ps.get_pipeline_model_parallel_group())
    by_layer: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for part in parts:
        if part is None:
            continue
        ids, used, own = part
        for j, layer in enumerate(ids):
            if layer in by_layer:
                raise ValueError(f"layer {layer} captured by two pipeline stages")
            by_layer[layer] = (used[:, :, j], own[:, :, j])
    missing = [i for i in trace_layers if i not in by_layer]
    if missing:
        raise ValueError(f"no pipeline stage captured layers {missing} (captured {sorted(by_layer)})")
    return tuple(torch.stack([by_layer[i][k] for i in trace_layers], dim=2) for k in (0, 1))
