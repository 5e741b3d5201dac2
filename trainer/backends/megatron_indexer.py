"""The embedded model's DSA-style indexer inside megatron-core's self-attention, with replay.

megatron-core 0.16.1's own DSA indexer builds on CPU without TransformerEngine but serves
multi-latent attention only (the MLA families', :mod:`replayrl.trainer.backends.megatron_dsa`),
not the embedded model's grouped-query attention. The embedded policy's indexer
(:mod:`replayrl.rollout.model.indexer`: a lightning-indexer scorer whose top-k keys restrict the layer's
attention) is therefore placed in front of megatron's local ``SelfAttention``:
``IndexedSelfAttention`` (built by :func:`indexed_attention_class`) scores the layer's attention
input, picks or replays the key slots exactly as
:class:`replayrl.rollout.model.qwen3_moe.Qwen3MoeAttention` does (:func:`~replayrl.rollout.model.indexer.select_topk`,
:func:`~replayrl.rollout.model.indexer.resolve_replay`, :func:`~replayrl.rollout.model.indexer.slots_to_mask`)
and hands megatron's attention the resulting mask (``True`` = masked out, megatron's
convention). Everything else (QKV, q/k norm, RoPE, softmax, output projection, TP / SP) is
megatron's (docs/design/megatron.md#megatron-backend).

Under sequence parallelism each rank all-gathers the (no-grad) attention input over the TP
group, and under context parallelism over the CP group (back in global order), so every rank
scores every query against all keys and computes the same slots; the CP core attention takes
its own query rows of the mask (docs/design/megatron.md#context-parallel). The indexer's weights are frozen, as in the
embedded model.

:class:`IndexerReplay` carries one forward's inputs (the padding layout and the replayed trace,
read per global layer through :class:`replayrl.trainer.parallel.replay_registry.ReplayRegistry`) to the
indexed layers and collects the slots they used and their own choices. Its state (the registry,
the armed inputs, the slots used and own per layer, the replay of one layer's top-k) is
:class:`IndexerReplayState`, which the MLA families' ``DSAReplay`` shares
(:mod:`replayrl.trainer.backends.megatron_dsa`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.indexer import Indexer, resolve_replay, select_topk, slots_to_mask
from replayrl.trainer.parallel.replay_registry import ReplayRegistry

__all__ = ["IndexerReplay", "IndexerReplayState", "indexed_attention_class"]


class IndexerReplayState:
    """One forward's indexer replay state on a model part: the trace columns it owns, the armed
    inputs and, per indexed layer, the key slots used and the indexer's own. Shared by the
    embedded model's indexer (:class:`IndexerReplay`) and megatron-core's DSA indexer
    (:class:`replayrl.trainer.backends.megatron_dsa.DSAReplay`); each arms ``_inputs`` in its
    own ``begin``.

    Args:
        config: the model config (``indexed_layers`` name the trace columns).
        layers: global ids of the layers built on this pipeline stage (those without an
            indexer replay nothing).
    """

    def __init__(self, config, layers) -> None:
        self.registry = ReplayRegistry.for_indexer(config)
        self.registry.register(layers)
        self._inputs = None
        self.used: dict[int, torch.Tensor] = {}
        self.own: dict[int, torch.Tensor] = {}

    @property
    def layers(self) -> tuple[int, ...]:
        """Global ids of the local indexed layers, increasing (the ``L_local`` axis)."""
        return self.registry.layers

    def _replay(self, layer: int, own: torch.Tensor, allowed: torch.Tensor,
                trace: torch.Tensor | None) -> torch.Tensor:
        """The slots global ``layer`` uses, ``[B, S, K]`` (-1 = none): its column of ``trace``
        (int ``[B, S, L_idx, K]``, or None: no replay) in place of the indexer's own ``own``
        ``[B, S, K]`` (:func:`~replayrl.rollout.model.indexer.resolve_replay`; ``allowed``:
        bool ``[B, S, S]``, the keys each query may attend); records both for :meth:`collect`.

        Raises:
            replayrl.rollout.model.ModelInputError: a replayed slot that is padding or in the future.
        """
        replay = self.registry.stream(trace, layer) if trace is not None else None
        used = resolve_replay(own, replay, allowed, layer)
        self.used[layer], self.own[layer] = used, own
        return used

    def collect(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(used, own)`` int32 ``[B, S, L_local, K]`` of the last forward, or None when this
        part has no indexed layer."""
        if not self.layers:
            return None
        return (torch.stack([self.used[i] for i in self.layers], 2).to(torch.int32),
                torch.stack([self.own[i] for i in self.layers], 2).to(torch.int32))

    def end(self) -> None:
        """Drop the forward's inputs and outputs."""
        self._inputs, self.used, self.own = None, {}, {}


class IndexerReplay(IndexerReplayState):
    """One forward's indexer inputs and outputs, shared by the indexed layers of a model part.

    Args:
        config: the model config (``indexed_layers`` name the trace columns).
        layers: global ids of the indexed layers built on this pipeline stage.
    """

    def begin(self, key_padding_mask: torch.Tensor, trace: torch.Tensor | None) -> None:
        """Arm one forward of right-padded rows.

        Args:
            key_padding_mask: bool ``[B, S]``, True = real token.
            trace: int ``[B, S, L_idx, K]`` key slots to replay (``-1`` rows keep the
                indexer's own choice), or None for the indexer's own choice everywhere.
        """
        s = key_padding_mask.shape[1]
        slot = torch.arange(s)
        causal = slot[None, :] <= slot[:, None]
        own_slot = (slot[None, :] == slot[:, None])[None]
        allowed = causal[None] & key_padding_mask[:, None, :]
        self.end()
        self._inputs = (allowed, allowed & key_padding_mask[:, :, None], own_slot, trace)

    def mask(self, layer: int, x: torch.Tensor, indexer: Indexer) -> torch.Tensor:
        """Megatron attention mask ``[B, 1, S, S]`` (True = masked out) of global ``layer``
        for attention inputs ``x`` ``[B, S, hidden]``; records the slots used and own.

        Raises:
            replayrl.rollout.model.ModelInputError: a replayed slot that is padding or in the future.
            RuntimeError: called outside :meth:`begin` / :meth:`end`.
        """
        if self._inputs is None:
            raise RuntimeError("IndexerReplay.mask called outside begin() / end()")
        allowed, candidates, own_slot, trace = self._inputs
        own = select_topk(indexer.scores(x, indexer.keys(x)), candidates, indexer.topk)
        keep = slots_to_mask(self._replay(layer, own, allowed, trace), x.shape[1])
        keep = keep | (own_slot & ~keep.any(-1, keepdim=True))  # a padding query sees itself
        return ~keep[:, None]


def indexed_attention_class(config: ModelConfig, replay: IndexerReplay):
    """megatron ``SelfAttention`` subclass whose attention is restricted by the indexer.

    ``config`` gives the indexer's shape; ``replay`` is the model part's shared
    :class:`IndexerReplay`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.attention import SelfAttention

    class IndexedSelfAttention(SelfAttention):
        """megatron's local self-attention behind the embedded model's indexer (HF names
        ``model.layers.i.self_attn.indexer.*`` map to ``decoder.layers.i.self_attention.indexer.*``)."""

        def __init__(self, *args, **kwargs):  # megatron's arguments, passed by keyword
            super().__init__(*args, **kwargs)
            self.indexer = Indexer(config.hidden_size, config.index_n_heads, config.index_head_dim,
                                   config.index_topk)

        def forward(self, hidden_states, attention_mask=None, **kwargs):
            """hidden_states ``[S_local, B, hidden]``; ``attention_mask`` is replaced by the
            indexer's mask of this layer (``[B, 1, S, S]`` over the whole row)."""
            x = hidden_states.detach()
            if self.config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
                parts = [torch.empty_like(x) for _ in range(ps.get_tensor_model_parallel_world_size())]
                dist.all_gather(parts, x.contiguous(), group=ps.get_tensor_model_parallel_group())
                x = torch.cat(parts)
            if ps.get_context_parallel_world_size() > 1:
                from replayrl.trainer.backends.megatron_context_parallel import ContextParallel

                x = ContextParallel.from_megatron().gather(x, 0)
            with torch.no_grad():
                mask = replay.mask(self.layer_number - 1, x.transpose(0, 1), self.indexer)
            return super().forward(hidden_states, attention_mask=mask, **kwargs)

    return IndexedSelfAttention
