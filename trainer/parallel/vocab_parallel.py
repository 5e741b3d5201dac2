"""Support-replay logprobs with the vocabulary split across tensor-parallel (TP) ranks.

Each TP rank holds the logits of one contiguous, equal vocabulary shard (Megatron's layout:
rank ``r`` of ``W`` owns ids ``[r * V_local, (r + 1) * V_local)``). The value equals
:func:`replayrl.trainer.loss.logprobs.support_logprobs` on the concatenated logits and costs exactly two
collectives per call (docs/design/trainer-math.md#trainer-math):

1. one MAX all-reduce of ``[N + F]`` row maxima (support rows, then fallback slots), detached:
   the logsumexp shift, whose value does not change the result;
2. one SUM all-reduce of ``[N + F + N]``: the shifted exp-sums over the support, over the full
   vocabulary for the fallback slots, and ``z_y`` (non-zero only on the rank owning ``y``).

The backward needs no collective: every rank computes the same replicated output, so its
upstream gradient is the same everywhere and the SUM all-reduce back-propagates as the
identity (Megatron's ``reduce_from_tensor_model_parallel_region``); each rank obtains the
gradient of its own logits shard.

Source: Megatron-LM ``vocab_parallel_cross_entropy`` (max + sum all-reduces), restricted to the
captured support.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from replayrl.trainer.errors import LogprobError
from replayrl.trainer.loss.logprobs import _check_logits, _check_temperature, _fallback_slots, _validate_support

__all__ = ["vocab_parallel_support_logprobs"]


class _SumAllReduce(torch.autograd.Function):
    """All-reduce SUM forward; identity backward (the consumer is replicated on every rank)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def vocab_parallel_support_logprobs(
    local_logits: Tensor,
    support: Tensor,
    temperature: float,
    *,
    group: dist.ProcessGroup | None = None,
    fallback_rows: Tensor | None = None,
) -> Tensor:
    """Support-replay logprobs ``z_y - logsumexp_{v in S} z_v`` from a vocabulary shard.

    Must be called by every rank of ``group`` with the same ``support``, ``temperature`` and
    ``fallback_rows`` (they are replicated across TP ranks), and the output must feed a loss
    that is itself replicated (identical upstream gradient on every rank).

    Args:
        local_logits: float tensor [N, V_local], this rank's vocabulary shard of the logits
            (ids ``[rank * V_local, (rank + 1) * V_local)``; the global vocabulary is
            ``V_local * world_size``).
        support: integer tensor [N, 1+K] (``sample_support``) with *global* ids, as in
            :func:`replayrl.trainer.loss.logprobs.support_logprobs`.
        temperature: ``T > 0``.
        group: the tensor-parallel process group (default: the world).
        fallback_rows: optional fixed synthetic-EOS fallback slots [F] covering every fallback
            row (see :mod:`replayrl.trainer.loss.logprobs`).

    Returns:
        float32 tensor [N], identical on every rank; padding rows are 0 with no gradient.
        Differentiable w.r.t. ``local_logits``.

    Raises:
        SupportError, LogprobError: as :func:`replayrl.trainer.loss.logprobs.support_logprobs` (checked on
            every rank against the global vocabulary), or torch.distributed not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise LogprobError("vocab_parallel_support_logprobs needs an initialised process group")
    _check_logits(local_logits, "local_logits")
    t = _check_temperature(temperature)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n, v_local = local_logits.shape
    start = rank * v_local
    kinds = _validate_support(support, n, v_local * world, local_logits.device)
    slots = _fallback_slots(kinds, fallback_rows, n)
    n_slots = slots.numel()

    # Local view of the gathered ids: only ids this shard owns contribute.
    owned = (kinds.ids >= start) & (kinds.ids < start + v_local)  # [N, 1+K]
    local_ids = torch.where(owned, kinds.ids - start, torch.zeros_like(kinds.ids))
    z = local_logits.gather(1, local_ids).float() / t  # [N, 1+K]
    # lse_mask keeps one dummy column (id 0, owned by rank 0) for rows without candidates,
    # so every row has a finite global maximum.
    cand = kinds.lse_mask & owned[:, 1:]  # [N, K]
    neg_inf = torch.tensor(float("-inf"), device=z.device)
    z_cand = torch.where(cand, z[:, 1:], neg_inf)
    if n_slots:
        z_full = local_logits[slots].float() / t  # [F, V_local]

    with torch.no_grad():
        local_max_c = z_cand.max(dim=1).values if z_cand.shape[1] else z.new_zeros(n)
        local_max_f = z_full.max(dim=1).values if n_slots else z.new_zeros(0)
        maxima = torch.cat([local_max_c, local_max_f])
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    m_c, m_f = maxima[:n], maxima[n:]

    if z_cand.shape[1]:
        # where() before exp: a -inf - finite difference is fine, but keep the masked branch
        # out of the gradient entirely.
        sum_c = torch.where(cand, (z[:, 1:] - m_c[:, None]), neg_inf).exp().sum(dim=1)
    else:
        sum_c = z.new_ones(n)  # K == 0: every live row is a fallback row; value discarded
    sum_f = (z_full - m_f[:, None]).exp().sum(dim=1) if n_slots else z.new_zeros(0)
    y_owned = owned[:, 0] & ~kinds.pad
    zy_local = torch.where(y_owned, z[:, 0], torch.zeros_like(z[:, 0]))
    reduced = _SumAllReduce.apply(torch.cat([sum_c, sum_f, zy_local]), group)
    sum_c, sum_f, zy = reduced[:n], reduced[n : n + n_slots], reduced[n + n_slots :]

    lse = m_c + sum_c.log()
    if n_slots:
        lse_full = m_f + sum_f.log()
        lse = lse.index_put((slots,), torch.where(kinds.fallback[slots], lse_full, lse[slots]))
    lp = zy - lse
    return torch.where(kinds.pad, torch.zeros_like(lp), lp)
