"""The DSA lightning indexer of DeepSeek-V3.2 / GLM-5 on megatron-core's MLA: megatron-core's own
``DSAttention`` and ``DSAIndexer``, with replay of the indexer's top-k.

megatron-core 0.16.1 ships DeepSeek sparse attention as an experimental attention variant
(``transformer/experimental_attention_variant/dsa.py``): ``MLASelfAttention`` hands its core
attention the layer input and the compressed query (``experimental_attention_variant="dsa"``),
``DSAttention`` asks its ``DSAIndexer`` for the top-k keys of every query and runs the unfused
torch sparse attention (``unfused_dsa_fn``: the scores outside the top-k and the future masked
with -inf, softmax in float32). Measured here, it builds and runs on CPU without
TransformerEngine; two pieces do not (docs/design/megatron.md#megatron-families):

* ``DSAIndexer`` builds its projections with ``parallel_mode="duplicated"``, a keyword only
  TransformerEngine's linear takes: :func:`dsa_classes`' ``DuplicatedLinear`` is megatron's local
  ``Linear`` taking it (replicated weights, never summed over TP: every TP rank scores the whole
  gathered sequence);
* its ``rotate_activation`` (a Hadamard rotation of q and k) asserts bfloat16 and needs the CUDA
  package ``fast_hadamard_transform``. The rotation is orthogonal, so ``Hq . Hk = q . k``:
  transformers' indexers skip it, and so does this one (the rotation is the identity while
  megatron's ``forward_with_scores`` runs), which computes transformers' scores exactly.

What is ours is the replay: the indexer's own top-k is captured (slots that are no allowed key
written -1) and, with a trace, replaced before ``DSAttention`` builds its sparse mask: a -1 slot
selects nothing (it repeats the row's first replayed slot), a row of only -1 keeps the indexer's
choice (:func:`replayrl.rollout.model.indexer.resolve_replay`, as the family room's indexer hook).
GLM-5's ``indexer_types`` "shared" layers have no indexer: they attend the previous "full"
layer's keys (:class:`DSAReplay` hands them on), as transformers' ``GlmMoeDsaAttention``.

The indexer's column layout differs: transformers puts the rotary columns first per head
(``[rope; pass]``; DeepSeek-V3.2 rotates half-split pairs, GLM-5 interleaved pairs), megatron
last (``[pass; rope]``, interleaved pairs, as its MLA rotary). The weight conversion reorders
the rows of ``wq_b`` (per head), ``wk`` and ``k_norm`` by :func:`indexer_column_order`; the
scores are sums over the columns, so they do not change.
"""
from __future__ import annotations

import contextlib

import torch

from replayrl.trainer.backends.megatron_indexer import IndexerReplayState

__all__ = ["INDEXER_NORM_EPS", "DSAReplay", "dsa_classes", "indexer_column_order",
           "indexer_kinds", "train_indexer"]

INDEXER_NORM_EPS = 1e-6
"""transformers builds the indexer's ``k_norm`` LayerNorm with eps 1e-6; megatron's with
``layernorm_epsilon`` (``rms_norm_eps``), so the built ``k_norm`` is set to this value."""


def indexer_kinds(config) -> tuple[str, ...]:
    """Per global layer ``"full"`` (its own indexer) or ``"shared"`` (the previous full layer's
    keys: GLM-5's ``indexer_types``); DeepSeek-V3.2 indexes every layer.

    Args:
        config: a ``FamilyConfig`` of ``deepseek_v32`` / ``glm_moe_dsa``.
    """
    return tuple("full" if i in config.indexed_layers else "shared"
                 for i in range(config.num_hidden_layers))


def indexer_column_order(config) -> torch.Tensor:
    """int64 ``[index_head_dim]``: megatron's indexer column ``j`` (per head) is transformers'
    column ``order[j]``.

    transformers: rotary columns ``0 .. r-1`` then the rest (``r = qk_rope_head_dim``);
    DeepSeek-V3.2 rotates the pairs ``(i, i + r/2)`` by frequency ``i``, GLM-5 the pairs
    ``(2i, 2i+1)``. megatron: the rest, then ``r`` rotary columns whose pairs ``(2i, 2i+1)``
    rotate by frequency ``i`` (its MLA rotary de-interleaves)."""
    hf = config.hf_config()
    d, r = int(hf.index_head_dim), int(hf.qk_rope_head_dim)
    rope = torch.arange(r)
    if config.family == "deepseek_v32":  # half-split pairs -> interleaved pairs
        rope = torch.stack([torch.arange(r // 2), torch.arange(r // 2) + r // 2], -1).reshape(-1)
    return torch.cat([torch.arange(r, d), rope])


class DSAReplay(IndexerReplayState):
    """One forward's indexer inputs and outputs, shared by the DSA layers of a model part
    (the state and interface of :class:`replayrl.trainer.backends.megatron_indexer.IndexerReplay`,
    whose :attr:`layers` are the local indexed ("full") layers), and the keys each layer
    attended, for the "shared" layers above it.

    Args:
        config: the ``FamilyConfig`` (``indexed_layers`` name the trace columns).
        layers: global ids of the decoder layers built on this pipeline stage.
    """

    def __init__(self, config, layers) -> None:
        super().__init__(config, layers)
        self.k = int(config.index_topk)
        self.fed: dict[int, torch.Tensor] = {}  # layer -> the keys it attended (for "shared")

    def begin(self, key_padding_mask: torch.Tensor, trace: torch.Tensor | None) -> None:
        """Arm one forward of right-padded rows.

        Args:
            key_padding_mask: bool ``[B, S]``, True = real token (S: the model's whole rows).
            trace: int ``[B, S, L_idx, K]`` key slots to replay (-1 = none; a row of only -1
                keeps the indexer's choice), or None for the indexers' own choice.
        """
        s = key_padding_mask.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        real = key_padding_mask.bool()
        self.end()
        self._inputs = (causal[None] & real[:, None, :] & real[:, :, None], trace)

    def select(self, layer: int, raw: torch.Tensor) -> torch.Tensor:
        """The keys global ``layer`` attends: int64 ``[B, S, max(K, k')]`` for ``DSAttention``'s
        sparse mask, from the indexer's own top-k ``raw`` ``[B, S, k']`` (``k' = min(K, S)``);
        records the slots used and the indexer's own (``[B, S, K]``, -1 = none).

        Without :meth:`begin` every key is real and nothing is replayed or recorded.

        Raises:
            replayrl.rollout.model.ModelInputError: a replayed slot is padding or in the future.
        """
        b, s, _ = raw.shape
        if self._inputs is None:
            self.fed[layer] = raw
            return raw
        allowed, trace = self._inputs
        allowed = allowed.to(raw.device)
        own = _pad(torch.where(allowed.gather(-1, raw), raw, -1), self.k)
        used = self._replay(layer, own, allowed, trace)
        # a -1 slot selects nothing: it repeats the row's first slot; a row without any slot
        # (a padding query) attends as the indexer chose (its logits are not read)
        picked = used >= 0
        first = used.gather(-1, picked.long().argmax(-1, keepdim=True))
        feed = torch.where(picked, used, first)
        feed = torch.where(picked.any(-1, keepdim=True), feed, _pad(raw, self.k, raw[..., :1]))
        self.fed[layer] = feed
        return feed

    def shared(self, layer: int) -> torch.Tensor:
        """The keys of the last indexed layer below global ``layer`` (GLM-5's "shared" layer).

        Raises:
            RuntimeError: no indexed layer below ``layer`` ran in this forward.
        """
        below = [i for i in self.fed if i < layer]
        if not below:
            raise RuntimeError(f"DSA layer {layer} shares the top-k of an earlier indexed layer, "
                               f"but none ran before it in this forward")
        return self.fed[max(below)]

    def end(self) -> None:
        """Drop the forward's inputs and outputs, the attended keys included."""
        super().end()
        self.fed = {}


def _pad(x: torch.Tensor, k: int, fill: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[B, S, k']`` widened to ``k`` columns: -1, or ``fill`` ``[B, S, 1]`` repeated."""
    if x.shape[-1] >= k:
        return x
    shape = (*x.shape[:-1], k - x.shape[-1])
    extra = x.new_full(shape, -1) if fill is None else fill.expand(shape)
    return torch.cat([x, extra], -1)


@contextlib.contextmanager
def _identity_rotation():
    """megatron's ``rotate_activation`` as the identity while the block runs (see the module
    docstring: an orthogonal rotation transformers skips; megatron's needs a CUDA package)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    original = dsa.rotate_activation
    dsa.rotate_activation = lambda x: x
    try:
        yield
    finally:
        dsa.rotate_activation = original


def dsa_classes(config, replay: DSAReplay):
    """``(indexed, shared, indexer, linear)``: megatron-core's ``DSAttention`` with the replay
    (:class:`DSAReplay`), the "shared" layers' attention (the previous indexed layer's keys, no
    indexer), megatron's ``DSAIndexer`` whose top-k goes through the replay, and the local
    ``Linear`` taking ``parallel_mode``. Built lazily (megatron is imported with the backend)."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.module import MegatronModule

    DSAIndexer, DSAttention, unfused_dsa_fn = dsa.DSAIndexer, dsa.DSAttention, dsa.unfused_dsa_fn

    class DuplicatedLinear(Linear):
        """megatron's local ``Linear`` accepting ``parallel_mode`` (only "duplicated"): the same
        weight on every TP rank, applied to the gathered sequence, so its gradient is whole on
        every rank (not marked ``sequence_parallel``)."""

        def __init__(self, *args, parallel_mode: str = "duplicated", **kwargs):
            if parallel_mode != "duplicated":
                raise ValueError(f"DuplicatedLinear: parallel_mode {parallel_mode!r}")
            super().__init__(*args, **kwargs)
            for p in self.parameters():
                p.sequence_parallel = False

    class ReplayedIndexer(DSAIndexer):
        """megatron's ``DSAIndexer`` whose top-k goes through :meth:`DSAReplay.select`
        (``layer``: its global layer id, set by the attention that owns it)."""

        layer = -1

        def forward_with_scores(self, x, qr, mask=None, packed_seq_params=None):
            """megatron's scores ``[B, S, S]`` and the keys to attend ``[B, S, K]``."""
            with _identity_rotation():
                scores, raw = super().forward_with_scores(x, qr, mask, packed_seq_params)
            return scores, replay.select(self.layer, raw)

    class IndexedAttention(DSAttention):
        """megatron's ``DSAttention`` on a "full" layer (its indexer replayed)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.indexer.layer = self.layer_number - 1
            self.indexer.k_norm.eps = INDEXER_NORM_EPS
            for p in self.indexer.k_norm.parameters():
                p.sequence_parallel = False  # applied to the gathered sequence, as the linears

        def forward(self, *args, **kwargs):
            """megatron's forward; at loss coefficient 0 (the frozen indexer) without the
            indexer loss, which megatron computes in every training forward (a dense
            ``[B, heads, S, S]`` attention per layer) and scales by 0."""
            if getattr(self.config, "dsa_indexer_loss_coeff", None):
                return super().forward(*args, **kwargs)
            training, self.training = self.training, False  # the loss's only switch here
            try:
                return super().forward(*args, **kwargs)
            finally:
                self.training = training

    class SharedAttention(MegatronModule):
        """A "shared" layer's sparse attention: megatron's ``unfused_dsa_fn`` over the keys of
        the previous indexed layer; no indexer, no indexer loss."""

        def __init__(self, config, submodules=None, layer_number=1, attn_mask_type=None,
                     attention_type=None, attention_dropout=None, softmax_scale=None,
                     k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            self.layer_number = layer_number
            # megatron's base Attention builds a first core without MLA's arguments, then MLA its own
            width = k_channels or config.kv_channels
            self.softmax_scale = softmax_scale if softmax_scale is not None else width ** -0.5

        def forward(self, query, key, value, attention_mask, x=None, qr=None, **kwargs):
            """query / key ``[S, B, heads, d]``, value ``[S, B, heads, dv]`` -> ``[S, B, heads * dv]``."""
            return unfused_dsa_fn(query, key, value, replay.shared(self.layer_number - 1),
                                  self.softmax_scale)

    return IndexedAttention, SharedAttention, ReplayedIndexer, DuplicatedLinear


def dsa_core_attention_specs(config, replay: DSAReplay, global_layers) -> list:
    """The core-attention ``ModuleSpec`` of each built layer (global ids ``global_layers``)."""
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    indexed, shared, indexer, linear = dsa_classes(config, replay)
    indexer_spec = ModuleSpec(module=indexer, submodules=dsa.DSAIndexerSubmodules(
        linear_wq_b=linear, linear_wk=linear, k_norm=WrappedTorchNorm, linear_weights_proj=linear))
    kinds = indexer_kinds(config)
    return [ModuleSpec(module=indexed, submodules=dsa.DSAttentionSubmodules(indexer=indexer_spec))
            if kinds[i] == "full" else ModuleSpec(module=shared) for i in global_layers]


def train_indexer(model, coeff: float) -> int:
    """Let the indexers of a built DSA model learn by megatron-core's KL loss
    (``compute_dsa_indexer_loss``: KL of the indexer's softmax from the main attention's,
    summed over heads, dense, per query; attached to each ``DSAttention`` output in training
    forwards), scaled by ``coeff`` per microbatch. Their parameters are made trainable; the
    loss reaches only them (``DSAttention`` detaches its inputs). Call before wrapping the
    model in megatron's DDP (it buffers the trainable parameters).

    Returns:
        the number of ``DSAttention`` layers whose indexer now learns.

    Raises:
        replayrl.trainer.errors.MegatronModelError: ``coeff`` not above 0, or the model has
            no DSA indexer on this rank (not a ``deepseek_v32`` / ``glm_moe_dsa`` policy).
    """
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    from replayrl.trainer.errors import MegatronModelError

    if not coeff > 0:
        raise MegatronModelError(f"--dsa-indexer-loss-coeff must be above 0 to train the "
                                 f"indexer, got {coeff!r}")
    layers = [m for m in model.modules() if isinstance(m, DSAttention)]
    if not layers:
        raise MegatronModelError("--dsa-indexer-loss-coeff: the policy has no DSA indexer on "
                                 "this rank (only deepseek_v32 / glm_moe_dsa checkpoints have one)")
    for attention in layers:
        attention.config.dsa_indexer_loss_coeff = float(coeff)
        for p in attention.indexer.parameters():
            p.requires_grad_(True)
    return len(layers)
