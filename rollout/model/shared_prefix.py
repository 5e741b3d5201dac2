"""Decode attention over a prompt shared by blocks of rows, read once per block (cascade attention).

The engine prefills each distinct prompt once and decodes the ``R`` samples of a prompt group
side by side. A dense attention layer's cached keys then hold every group's prompt ``R`` times
over, and a decode step reads them all: at the 1m x 64 grid point (128 rows, 70 prompt slots) the
prompt is most of what ``scaled_dot_product_attention`` reads, the engine's largest row
(docs/benchmarks.md as of 58f8d09, the grid's profile). Here the prompt's keys and values stay
one row per block; a decode
query attends to them as one query of its block (``R`` rows x the query heads of a KV head, one
attention call over ``G`` blocks), to its own row's keys after the prompt (a second call), and the
two partial results are merged by their log-sum-exps, as FlashInfer's cascade attention and
Hydragen (Juravsky et al., 2024) do. The result is the same softmax over the same keys, up to
float rounding (sums in another order).

CPU only: the two calls are torch's flash-attention CPU kernel, which returns the log-sum-exp
(``aten::_scaled_dot_product_flash_attention_for_cpu``); :func:`can_share` says where it applies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SharedPrefix", "block_size", "can_share", "shared_prefix_attention"]


@dataclass(frozen=True)
class SharedPrefix:
    """The prompt keys of one dense attention layer, one row per block of ``rows`` batch rows.

    keys / values: ``[G, H_kv, P, D]`` (the model dtype); bias: ``[G, 1, 1, P]`` in the same dtype, 0 on a
    real key and ``-inf`` on a padding slot; rows: ``R``, the batch rows per block (batch row
    ``b`` reads block ``b // R``). Every block has at least one real key.
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    rows: int

    @property
    def length(self) -> int:
        """``P``, the key slots the prefix covers (padding included)."""
        return int(self.keys.shape[2])

    def expanded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix's keys and values repeated to one row per batch row, ``[G R, H_kv, P, D]``."""
        return (self.keys.repeat_interleave(self.rows, 0), self.values.repeat_interleave(self.rows, 0))


def block_size(rows: torch.Tensor) -> int:
    """``R`` when ``rows`` (int64 ``[B]``) is ``B / R`` runs of ``R > 1`` equal values each (the
    samples of a prompt group, side by side), else 0."""
    b = len(rows)
    change = (rows[1:] != rows[:-1]).nonzero()
    r = int(change[0, 0]) + 1 if len(change) else b
    if r < 2 or b % r:
        return 0
    return r if bool((rows.view(-1, r) == rows[::r, None]).all()) else 0


def can_share(q: torch.Tensor) -> bool:
    """Whether :func:`shared_prefix_attention` serves queries ``q`` ``[B, H, S, D]``: one new
    token per row, on the CPU, without autograd."""
    return q.device.type == "cpu" and q.shape[2] == 1 and not torch.is_grad_enabled()


def shared_prefix_attention(q: torch.Tensor, prefix: SharedPrefix, keys: torch.Tensor,
                            values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one decode query per row over its block's prefix and its own later keys.

    Args:
        q: ``[B, H, 1, D]`` (``B = G R``; query head ``h`` reads KV head ``h // (H / H_kv)``).
        prefix: the block-shared keys before slot ``P``.
        keys, values: ``[B, H_kv, T - P, D]``, each row's own key slots from ``P`` on.
        mask: bool ``[B, 1, T - P]``, True where a query may attend (at least one per row).
        scale: the softmax scale.

    Returns:
        ``[B, H, 1, D]`` in ``q``'s dtype: softmax over the prefix's real keys and the allowed
        own keys, the weighted sum of their values (the same as one attention over all ``T``
        slots with the prefix repeated per row, up to float rounding).
    """
    b, h, _, d = q.shape
    h_kv, r = keys.shape[1], prefix.rows
    g, rep = b // r, h // h_kv
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # block queries: [G, H_kv, R * rep, D], each block's R rows x the rep heads of a KV head
    q_rows = q.reshape(b, h_kv, rep, d)
    q_block = q_rows.view(g, r, h_kv, rep, d).transpose(1, 2).reshape(g, h_kv, r * rep, d)
    out_p, lse_p = flash(q_block, prefix.keys, prefix.values, attn_mask=prefix.bias, scale=scale)
    out_p = out_p.view(g, h_kv, r, rep, d).transpose(1, 2).reshape(b, h_kv, rep, d)
    lse_p = lse_p.view(g, h_kv, r, rep).transpose(1, 2).reshape(b, h_kv, rep, 1)
    own_bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out_o, lse_o = flash(q_rows, keys, values, attn_mask=own_bias[:, None], scale=scale)
    lse_o = lse_o.unsqueeze(-1)
    top = torch.maximum(lse_p, lse_o)
    w_p, w_o = (lse_p - top).exp_(), (lse_o - top).exp_()
    out = (out_p.float() * w_p + out_o.float() * w_o) / (w_p + w_o)
    return out.to(q.dtype).reshape(b, h, 1, d)
