"""Prefix-tree layout: rows that share a prompt forwarded as one row, the prompt once.

The samples of a GRPO prompt group share their prompt (and the engine prefilled it once, so
its routing and indexer traces are equal across the group). The trainer lays each distinct
prompt out once as a *trunk* and every sample's continuation after it as a *branch* of the
same tree row::

    tree row u:  [ trunk (P slots) | branch 0 (L slots) | branch 1 (L slots) | ... ]

with ``P`` the shared prefix length, ``L = W - P`` the forwarded width after it (every branch
has the same length; a shorter sample's branch ends in padding) and branch ``k`` the ``k``-th
row (in batch order) with that prefix. The model's ``segment_ids`` give the trunk segment -1,
which every later query sees, and branch ``k`` segment ``k``, which only its own queries see, so
each query attends exactly to the keys it had in its own row: the same math as forwarding every
row alone, in ONE forward of ``U`` tree rows instead of a prompt pass plus a KV-cache pass (the
fixed per-op cost, not arithmetic, bounds this model on a CPU; docs/design/trainer-math.md#trainer-math).
Gradients of the trunk sum over its branches by autograd. The same idea is "shared-prefix
packing" in verl / "prefix tree" attention in the literature (e.g. Hydragen, Juravsky et al.
2024, for inference).

Positions keep their RoPE values (position ids are carried, not recomputed). Indexer key slots
are the only values that move: a slot ``v >= P`` of branch ``k`` is ``v + k * L`` in the tree;
the mapping back subtracts it again (a query of branch ``k`` can only see the trunk and branch
``k``, so its slots invert unambiguously).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PrefixTree"]


@dataclass(frozen=True)
class PrefixTree:
    """Where every ``(row, position)`` of a ``[B, W]`` batch sits in the ``[U, P + n L]`` tree.

    Build with :meth:`build`. Attributes:
        prefix: ``P``, the trunk length (>= 1). width: ``W``, the forwarded width (>= P).
        first: int64 [U] the first batch row of each distinct prefix.
        inverse: int64 [B] the tree row of every batch row.
        branch: int64 [B] the branch index of every batch row inside its tree row.
        slot: int64 [B, W] the tree slot of every batch position.
        tree_width: ``P + max branches * L``.
    """

    prefix: int
    width: int
    first: torch.Tensor
    inverse: torch.Tensor
    branch: torch.Tensor
    slot: torch.Tensor
    tree_width: int

    @classmethod
    def build(cls, prefix: int, width: int, first: torch.Tensor,
              inverse: torch.Tensor) -> "PrefixTree":
        """The layout of rows whose first ``prefix`` positions are shared as ``inverse`` says.

        Args:
            prefix: trunk length, ``1 <= prefix <= width``.
            width: forwarded positions per batch row.
            first: int64 [U], first batch row of each distinct prefix (as ``torch.unique``'s
                groups); inverse: int64 [B], distinct prefix of every batch row (the layout's
                tensors are built on its device).

        Raises:
            ValueError: ``prefix`` outside ``[1, width]`` or ``inverse`` not naming ``first``'s rows.
        """
        if not 1 <= prefix <= width:
            raise ValueError(f"prefix must lie in [1, width={width}], got {prefix}")
        if inverse.dim() != 1 or (len(inverse) and int(inverse.max()) >= len(first)):
            raise ValueError(f"inverse must be int64 [B] in [0, {len(first)}), got {inverse.tolist()}")
        b = len(inverse)
        # branch k = how many earlier rows share this row's prefix (stable: batch order)
        same = inverse[:, None] == inverse[None, :]
        branch = (same & torch.ones(b, b, dtype=torch.bool, device=inverse.device).tril(-1)).sum(1)
        length = width - prefix
        j = torch.arange(width, device=inverse.device)
        slot = torch.where(j < prefix, j, j + branch[:, None] * length)
        branches = int(branch.max()) + 1 if b else 0
        return cls(prefix, width, first, inverse, branch, slot, prefix + branches * length)

    @property
    def rows(self) -> int:
        """``U``, the number of tree rows."""
        return len(self.first)

    def to_tree(self, x: torch.Tensor, fill) -> torch.Tensor:
        """``x`` [B, W, ...] laid out as [U, tree_width, ...]; slots no row writes hold ``fill``.

        The trunk is written by every row of its tree row; the caller guarantees those rows are
        equal there (:func:`replayrl.trainer.backends.torch_backend._shared_prefix` checks it).
        """
        out = x.new_full((self.rows, self.tree_width, *x.shape[2:]), fill)
        out[self.inverse[:, None], self.slot] = x
        return out

    def segment_ids(self) -> torch.Tensor:
        """int64 [U, tree_width]: -1 on the trunk, the branch index on each branch (and on the
        unused tail of a tree row with fewer branches, whose slots are padding)."""
        j = torch.arange(self.tree_width, device=self.inverse.device)
        seg = torch.where(j < self.prefix, -1,
                          (j - self.prefix) // max(self.width - self.prefix, 1))
        return seg.expand(self.rows, -1)

    def indexer_to_tree(self, slots: torch.Tensor) -> torch.Tensor:
        """Indexer key slots [B, W, L_idx, K] of each row's own layout -> tree slots (-1 kept)."""
        shift = (self.branch * (self.width - self.prefix))[:, None, None, None]
        return torch.where(slots >= self.prefix, slots + shift, slots)

    def from_tree(self, x: torch.Tensor) -> torch.Tensor:
        """Tree-layout [U, tree_width, ...] -> every batch row's [B, W, ...] (a gather)."""
        return x[self.inverse[:, None], self.slot]

    def indexer_from_tree(self, slots: torch.Tensor) -> torch.Tensor:
        """Tree-layout indexer slots [U, tree_width, L_idx, K] -> [B, W, L_idx, K] in each row's
        own layout (-1 kept): the inverse of :meth:`indexer_to_tree`."""
        rows = self.from_tree(slots)
        shift = (self.branch * (self.width - self.prefix))[:, None, None, None]
        return torch.where(rows >= self.prefix, rows - shift, rows)

    def at(self, x: torch.Tensor, row: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Tree-layout [U, tree_width, ...] values at batch ``(row, pos)`` (int64 [N]) -> [N, ...]."""
        return x[self.inverse[row], self.slot[row, pos]]
