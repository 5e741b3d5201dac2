"""A family's model: transformers' own modeling class with capture and replay at routers and indexers.

:class:`FamilyModel` keeps the call signature of
:class:`replayrl.rollout.model.qwen3_moe.Qwen3MoeForCausalLM` (token ids, per-row positions, a
key padding mask, a KV cache, `routed_experts` / `indexer_topk` to replay, `capture`), so the
embedded engine and the torch trainer drive it unchanged. The math is transformers' (eager
attention); two hooks of ours sit on its modules:

* router (`mlp.gate` / `mlp.router`, returning `(router_logits, weights, top-k ids)`): capture
  = the expert ids transformers chose (for DeepSeek / GLM after the bias correction and the
  group-limited selection); replay = those ids are forced and the weights recomputed from the
  live router logits (`FamilySpec.router_weights`), so the router still gets gradients (R3, as
  the torch backend does for qwen3_moe). A replay row of only -1 keeps the router's choice.
* indexer (`self_attn.indexer`, returning the top-k key indices): capture = its picks, with the
  slots that are no allowed key (a query seeing fewer than `index_topk` keys; padding queries)
  written as -1; replay = the given key slots become the selection (the attention mask keeps only
  them); -1 slots select nothing, a row of only -1 keeps the indexer's own choice.

Traces: routed experts int32 `[B, S, L_moe, K]`, indexer slots int32 `[B, S, L_idx, index_topk]`
(slots index this row's cache + current keys), as in the embedded model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from replayrl.rollout.model.errors import CheckpointError, ModelConfigError, ModelInputError
from replayrl.rollout.model.qwen3_moe import CausalLMOutput
from replayrl.transport import strict_json

# config.json fields that change the math in ways the family code does not reproduce
_REFUSED_FIELDS = ("quantization_config",)


def sigmoid_router_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor
                           ) -> torch.Tensor:
    """DeepSeek-V3 / GLM routing weights of `experts` (int64 `[N, K]`) from float32 router
    logits `[N, E]`: sigmoid scores gathered (no bias: the correction only ranks),
    renormalised if `router.norm_topk_prob`, times `router.routed_scaling_factor`; `[N, K]`."""
    w = logits.sigmoid().gather(1, experts)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def softmax_topk_router_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor
                                ) -> torch.Tensor:
    """gpt-oss routing weights: softmax over the router logits of `experts` (int64 `[N, K]`),
    in the logits' dtype; `[N, K]`."""
    return F.softmax(logits.gather(1, experts), dim=1, dtype=logits.dtype)


@dataclass(frozen=True)
class FamilySpec:
    """What differs between families: the HF `model_type`, the router's attribute on a MoE
    layer's `mlp`, how replayed experts' weights are recomputed, and whether attention layers
    carry a DSA indexer (`self_attn.indexer`)."""

    model_type: str
    router_attr: str
    router_weights: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    has_indexer: bool
    model_class: type | None = None
    """A :class:`FamilyModel` subclass for a family whose routers / indexers sit elsewhere or
    take other arguments (it overrides `router_of` / `indexer_of` / `_hook_indexer` /
    `check_hf_dict`); None: :class:`FamilyModel` itself."""

    @property
    def model_cls(self) -> type:
        """The class that wraps this family's transformers model."""
        return self.model_class or FamilyModel


@dataclass(frozen=True)
class FamilyConfig:
    """The shape of a family checkpoint, read from its config.json (`FamilyConfig.from_hf_dict`).

    Carries what the run needs before any model is built (trace shapes, vocabulary, limits) and
    the whole config.json as canonical JSON text (`hf_json`), from which an engine builds the
    model. `moe_layers` / `indexed_layers`: global ids of the layers with a router / with an
    indexer of their own, found by building the model on the meta device.
    """

    family: str
    hf_json: str
    vocab_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    index_topk: int
    moe_layers: tuple[int, ...] = field(default=())
    indexed_layers: tuple[int, ...] = field(default=())
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        object.__setattr__(self, "indexed_layers", tuple(int(i) for i in self.indexed_layers))

    @property
    def hf_model_type(self) -> str:
        """The config.json `model_type`."""
        return self.family

    def hf_dict(self) -> dict[str, Any]:
        """The config.json dict."""
        return json.loads(self.hf_json)

    def hf_file_config(self):
        """The transformers `PretrainedConfig` of config.json as written (for a `text_tower`
        family the multimodal composite)."""
        from transformers import CONFIG_MAPPING

        d = self.hf_dict()
        d.pop("model_type", None)
        return CONFIG_MAPPING[self.family](**d)

    @property
    def text_tower(self) -> bool:
        """config.json is a multimodal composite (a `text_config`): the model run is its text
        tower, the other towers (vision, projector) are not loaded."""
        return isinstance(self.hf_dict().get("text_config"), dict)

    def hf_config(self):
        """The transformers `PretrainedConfig` of the model run (of a `text_tower` composite:
        its text config, tied as the composite ties), eager attention (the indexer mask path)."""
        cfg = self.hf_file_config()
        text = cfg.get_text_config()
        if text is not cfg:
            text.tie_word_embeddings = bool(cfg.tie_word_embeddings)
            cfg = text
        cfg._attn_implementation = "eager"
        return cfg

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "FamilyConfig":
        """Read a family's config.json dict. Raises `ModelConfigError` naming the field for an
        unregistered `model_type`, a refused field (`quantization_config`), a value transformers
        rejects, or a missing `vocab_size` / `num_hidden_layers`."""
        from replayrl.rollout.model.families import family_spec

        spec = family_spec(d.get("model_type"))
        for name in _REFUSED_FIELDS:
            if d.get(name) is not None:
                raise ModelConfigError(f"config.json field {name!r} is not supported for "
                                       f"model_type {spec.model_type!r}")
        spec.model_cls.check_hf_dict(d)
        hf_json = strict_json.dumps(d, sort_keys=True)  # a non-finite value is refused, named
        probe = cls(family=spec.model_type, hf_json=hf_json, vocab_size=0, num_hidden_layers=0,
                    max_position_embeddings=0, num_experts=0, num_experts_per_tok=0, index_topk=0)
        try:
            cfg = probe.hf_config()
        except (TypeError, ValueError, KeyError) as exc:
            raise ModelConfigError(f"config.json of model_type {spec.model_type!r} is rejected by "
                                   f"transformers: {type(exc).__name__}: {exc}") from None
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        layers = model.model.layers
        moe = tuple(i for i, layer in enumerate(layers)
                    if spec.model_cls.router_of(layer, spec) is not None)
        indexed = tuple(i for i, layer in enumerate(layers)
                        if spec.model_cls.indexer_of(layer) is not None)
        if spec.has_indexer and not indexed:
            raise ModelConfigError(f"config.json field 'index_topk' / 'indexer_types': model_type "
                                   f"{spec.model_type!r} has no indexed layer")
        k_idx = int(getattr(cfg, "index_topk", 0) or 0) if indexed else 0
        return cls(family=spec.model_type, hf_json=hf_json, vocab_size=int(cfg.vocab_size),
                   num_hidden_layers=int(cfg.num_hidden_layers),
                   max_position_embeddings=int(cfg.max_position_embeddings),
                   num_experts=int(getattr(cfg, "num_local_experts", 0)
                                   or getattr(cfg, "n_routed_experts", 0)
                                   or getattr(cfg, "num_experts", 0) or 0),
                   num_experts_per_tok=int(cfg.num_experts_per_tok), index_topk=k_idx,
                   moe_layers=moe, indexed_layers=indexed,
                   tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)))


class FamilyKVCache:
    """The KV cache of a family model: transformers' `DynamicCache` of its config (MLA's
    compressed latent and rotary key per layer, plus the indexer's key cache on DSA layers; a
    gated DeltaNet layer's convolution and recurrent state instead of keys), with the `length`
    / `select_rows` the embedded engine uses (`reorder_cache` selects the rows of every kind)."""

    def __init__(self, hf_config) -> None:
        from transformers import DynamicCache

        self.hf = DynamicCache(config=hf_config)

    @property
    def length(self) -> int:
        """Cached key slots per row (tokens consumed, when layer 0 is a linear-attention layer)."""
        return int(self.hf.get_seq_length())

    def select_rows(self, rows: torch.Tensor) -> "FamilyKVCache":
        """Keep / repeat the cache rows `rows` (int64 `[B']`), in place; returns self."""
        self.hf.reorder_cache(rows.long())
        return self


@dataclass(eq=False)
class _ForwardState:
    """What one :meth:`FamilyModel.forward` tells its router and indexer hooks, and what they
    capture for it. One object per model, shared with the hooks (they hold it, not the model):
    :meth:`begin` arms it at the start of a forward, :meth:`end` returns it to idle when the
    forward returns or raises, so between forwards nothing is replayed or captured and no
    captured tensor is kept alive. Layer ids are the global decoder-layer indices."""

    capture: bool = False
    """Whether the hooks record their choices (the forward's ``capture``)."""
    experts: dict[int, torch.Tensor] | None = None
    """Routing to replay: MoE layer -> expert ids int32/int64 ``[B, S, K]`` (a row of only -1
    keeps the router's choice); None: the routers choose."""
    slots: dict[int, torch.Tensor] | None = None
    """Indexer key slots to replay: indexed layer -> int32/int64 ``[B, S, index_topk]`` (-1 =
    none; a row of only -1 keeps the indexer's picks); None: the indexers choose."""
    query_real: torch.Tensor | None = None
    """bool ``[B, S]``: the queries of this forward that are not padding (the last S columns of
    the key padding mask); the indexer hook writes a padding query's slots as -1. None: idle."""
    used_experts: dict[int, torch.Tensor] = field(default_factory=dict)
    """Captured, MoE layer -> the expert ids the layer ran with (replayed where replayed),
    int64 ``[B*S, K]``: the router's tokens are the batch's, flattened."""
    own_experts: dict[int, torch.Tensor] = field(default_factory=dict)
    """Captured, MoE layer -> the router's own choice, int64 ``[B*S, K]`` (its top-k)."""
    used_slots: dict[int, torch.Tensor] = field(default_factory=dict)
    """Captured, indexed layer -> the key slots the layer attended (replayed where replayed),
    int64 ``[B, S, index_topk]``, -1 = none."""
    own_slots: dict[int, torch.Tensor] = field(default_factory=dict)
    """Captured, indexed layer -> the indexer's own picks, int64 ``[B, S, index_topk]``, the
    slots that are no allowed key (padding, non-causal) written as -1."""

    def begin(self, *, capture: bool, experts: dict[int, torch.Tensor] | None,
              slots: dict[int, torch.Tensor] | None, query_real: torch.Tensor | None) -> None:
        """Arm the hooks for one forward: what to replay, whether to capture (into fresh dicts)."""
        self.capture, self.experts, self.slots, self.query_real = capture, experts, slots, query_real
        self.used_experts, self.own_experts, self.used_slots, self.own_slots = {}, {}, {}, {}

    def end(self) -> None:
        """Back to idle: nothing replayed or captured, the forward's tensors dropped."""
        self.begin(capture=False, experts=None, slots=None, query_real=None)


class FamilyModel(nn.Module):
    """transformers' causal LM of a family, with router / indexer capture and replay.

    Build with `FamilyModel.from_config(config, dtype)` (random init, e.g. an engine before its
    first weight push) or `FamilyModel.from_pretrained(directory, dtype)`. `state_dict()` and
    parameter names are transformers' (HF checkpoint names). Indexer parameters are frozen:
    their top-k has no gradient (as in the embedded model).
    """

    supports_segment_ids = False

    def __init__(self, hf_model: nn.Module, config: FamilyConfig) -> None:
        super().__init__()
        from replayrl.rollout.model.families import family_spec

        self.hf = hf_model
        self.config = config
        self.spec = family_spec(config.family)
        self._state = _ForwardState()  # the hooks close over this object: mutated, never replaced
        self._moe_pos = {layer: j for j, layer in enumerate(config.moe_layers)}
        self._idx_pos = {layer: j for j, layer in enumerate(config.indexed_layers)}
        for i, layer in enumerate(hf_model.model.layers):
            if i in self._moe_pos:
                self._hook_router(self.router_of(layer, self.spec), i)
            if i in self._idx_pos:
                indexer = self.indexer_of(layer)
                for p in indexer.parameters():
                    p.requires_grad_(False)
                self._hook_indexer(indexer, i)

    @staticmethod
    def router_of(layer: nn.Module, spec: FamilySpec) -> nn.Module | None:
        """The router of decoder layer `layer` whose choice is traced (`mlp.<router_attr>`),
        or None (a dense layer)."""
        router = getattr(layer.mlp, spec.router_attr, None)
        return router if isinstance(router, nn.Module) else None

    @staticmethod
    def indexer_of(layer: nn.Module) -> nn.Module | None:
        """The sparse-attention indexer of decoder layer `layer` (`self_attn.indexer`), or None."""
        return getattr(layer.self_attn, "indexer", None)

    @staticmethod
    def check_hf_dict(d: dict[str, Any]) -> None:
        """Refuse config.json fields this family's code does not reproduce (none here);
        raises `ModelConfigError` naming the field."""

    @classmethod
    def from_config(cls, config: FamilyConfig, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> "FamilyModel":
        """Randomly initialised model (transformers' init) in `dtype` on `device`."""
        from transformers import AutoModelForCausalLM

        cls = cls._class_for(config)
        hf = AutoModelForCausalLM.from_config(config.hf_config(), dtype=dtype)
        return cls(hf.to(device), config)

    @classmethod
    def _class_for(cls, config: FamilyConfig) -> type:
        """`cls`, or the family's own subclass when called on FamilyModel itself."""
        from replayrl.rollout.model.families import family_spec

        return family_spec(config.family).model_cls if cls is FamilyModel else cls

    @classmethod
    def from_pretrained(cls, directory, config: FamilyConfig,
                        dtype: torch.dtype = torch.float32) -> "FamilyModel":
        """Load a checkpoint directory (transformers' `from_pretrained`: one safetensors file or
        shards with an index). Raises `CheckpointError` naming a missing / unexpected weight."""
        from transformers import AutoModelForCausalLM

        cls = cls._class_for(config)
        try:
            if config.text_tower:
                hf, info = _load_text_tower(directory, config, dtype)
            else:
                hf, info = AutoModelForCausalLM.from_pretrained(
                    str(directory), config=config.hf_config(), dtype=dtype,
                    output_loading_info=True)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot load {directory}: {exc}") from None
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            if info.get(kind):
                raise CheckpointError(f"{directory}: {kind.replace('_', ' ')[:-1]} "
                                      f"{sorted(map(str, info[kind]))[0]!r} ({len(info[kind])})")
        return cls(hf, config)

    # --- what the engine / trainer read --------------------------------------------------
    @property
    def lm_head(self) -> nn.Module:
        """The LM head (`[vocab, hidden]` weight)."""
        return self.hf.lm_head

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the parameters."""
        return self.hf.lm_head.weight.dtype

    def state_dict(self, *args, **kwargs):
        """transformers' state dict (HF names, no `hf.` prefix)."""
        return self.hf.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state dict with HF names into the wrapped model."""
        return self.hf.load_state_dict(state_dict, strict=strict, assign=assign)

    def new_kv_cache(self) -> FamilyKVCache:
        """An empty cache for this model (transformers' DynamicCache)."""
        return FamilyKVCache(self.hf.config)

    # --- hooks ----------------------------------------------------------------------------
    def _hook_router(self, router: nn.Module, layer: int) -> None:
        """Replace `router.forward` (global layer `layer`) by capture / replay around it."""
        original = router.forward
        weights_of = self.spec.router_weights
        state = self._state

        def forward(hidden_states):
            logits, weights, experts = original(hidden_states)
            own = experts
            replay = (state.experts or {}).get(layer)
            if replay is not None:
                replay = replay.reshape(-1, replay.shape[-1]).to(experts.device).long()
                experts = torch.where((replay < 0).all(-1, keepdim=True), experts.long(), replay)
                weights = weights_of(router, logits, experts).to(weights.dtype)
            if state.capture:
                state.used_experts[layer] = experts
                state.own_experts[layer] = own
            return logits, weights, experts

        router.forward = forward

    def _hook_indexer(self, indexer: nn.Module, layer: int) -> None:
        """Replace `indexer.forward` (global layer `layer`) by capture / replay around it.
        What it returns feeds transformers' own sparse mask: a replayed row's -1 slots repeat
        its first slot (selecting nothing new), an all -1 row keeps the indexer's picks."""
        original = indexer.forward
        state = self._state
        k = self.config.index_topk

        def forward(hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                    cache=None, **kwargs):
            raw = original(hidden_states, q_resid, position_embeddings, attention_mask,
                           position_ids, cache=cache, **kwargs).long()
            allowed = (attention_mask if attention_mask.dtype == torch.bool
                       else attention_mask == 0)                      # [B, S, T]
            allowed = allowed & state.query_real[:, :, None]
            own = torch.where(allowed.gather(-1, raw), raw, -1)
            replay = (state.slots or {}).get(layer)
            used, feed = own, raw
            if replay is not None:
                replay = replay.to(raw.device).long()
                picked = replay >= 0
                ok = allowed.gather(-1, replay.clamp(min=0))
                if bool((picked & ~ok).any()):
                    b, i, _ = torch.nonzero(picked & ~ok)[0].tolist()
                    raise ModelInputError(
                        f"indexer_topk replays a padding or non-causal key slot for layer {layer} "
                        f"at batch row {b}, query {i}: {replay[b, i].tolist()}")
                keep_own = ~picked.any(-1, keepdim=True)
                # -1 slots select nothing: they repeat the row's first replayed slot
                first = replay.gather(-1, picked.long().argmax(-1, keepdim=True))
                forced = torch.where(picked, replay, first)
                used = torch.where(keep_own, _pad_to(own, k), replay)
                feed = torch.where(keep_own, _pad_to(raw, k, fill_from=raw), forced)
            if state.capture:
                state.used_slots[layer] = _pad_to(used, k)
                state.own_slots[layer] = _pad_to(own, k)
            return feed.to(torch.int32)

        indexer.forward = forward

    # --- forward --------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                key_padding_mask: torch.Tensor | None = None,
                kv_cache: FamilyKVCache | None = None,
                routed_experts: torch.Tensor | None = None,
                indexer_topk: torch.Tensor | None = None,
                capture: bool = False,
                return_hidden: bool = False,
                compute_logits: bool = True,
                segment_ids: torch.Tensor | None = None) -> CausalLMOutput:
        """As `Qwen3MoeForCausalLM.forward` (same shapes, dtypes and trace semantics), without
        packed segments. Raises `ModelInputError` naming the argument for `segment_ids`, a trace
        whose layer columns (`L_moe` / `L_idx`) or width differ from the model's, or a value
        out of range."""
        cfg = self.config
        if segment_ids is not None:
            raise ModelInputError(f"segment_ids: packed rows are not supported by the "
                                  f"{cfg.family!r} family model")
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ModelInputError(f"input_ids must be an integer tensor [B, S], got "
                                  f"{input_ids.dtype} {list(input_ids.shape)}")
        b, s = input_ids.shape
        if b == 0 or s == 0 or int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size:
            raise ModelInputError(f"input_ids must be non-empty and lie in [0, vocab_size="
                                  f"{cfg.vocab_size}), got shape {list(input_ids.shape)}")
        if (not isinstance(position_ids, torch.Tensor) or tuple(position_ids.shape) != (b, s)
                or position_ids.dtype.is_floating_point):
            raise ModelInputError(f"position_ids must be an integer tensor [{b}, {s}]")
        s_past = kv_cache.length if kv_cache is not None else 0
        t = s_past + s
        if key_padding_mask is None:
            key_padding_mask = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
        if tuple(key_padding_mask.shape) != (b, t) or key_padding_mask.dtype != torch.bool:
            raise ModelInputError(f"key_padding_mask must be a bool tensor [B={b}, S_past+S={t}], "
                                  f"got {key_padding_mask.dtype} {list(key_padding_mask.shape)}")
        experts = _split_trace("routed_experts", routed_experts, cfg.moe_layers,
                               (b, s, len(cfg.moe_layers), cfg.num_experts_per_tok),
                               cfg.num_experts)
        slots = _split_trace("indexer_topk", indexer_topk, cfg.indexed_layers,
                             (b, s, len(cfg.indexed_layers), cfg.index_topk), t)
        self._state.begin(capture=capture, experts=experts, slots=slots,
                          query_real=key_padding_mask[:, s_past:])
        try:
            out = self.hf.model(input_ids=input_ids, attention_mask=key_padding_mask.long(),
                                position_ids=position_ids,
                                cache=kv_cache.hf if kv_cache is not None else None,
                                use_cache=kv_cache is not None)
            h = out.last_hidden_state
            logits = self.hf.lm_head(h) if compute_logits else None
            st = self._state
            stack = lambda d, layers: (torch.stack([d[i] for i in layers], dim=2).to(torch.int32)
                                       if capture and layers else None)
            shape_e = lambda x: None if x is None else x.view(b, s, len(cfg.moe_layers), -1)
            return CausalLMOutput(
                logits=logits, hidden=h if return_hidden else None,
                routed_experts=shape_e(stack({i: v.view(b, s, -1) for i, v in st.used_experts.items()},
                                             cfg.moe_layers)),
                own_routed_experts=shape_e(stack({i: v.view(b, s, -1) for i, v in st.own_experts.items()},
                                                 cfg.moe_layers)),
                indexer_topk=stack(st.used_slots, cfg.indexed_layers),
                own_indexer_topk=stack(st.own_slots, cfg.indexed_layers))
        finally:
            self._state.end()


def _load_text_tower(directory, config: FamilyConfig, dtype: torch.dtype):
    """The text causal LM of a multimodal composite checkpoint and its loading info: the whole
    checkpoint loaded by transformers' own image-text-to-text class (its weight renamings), then
    its language model and LM head moved into the text config's causal LM; the vision tower and
    projector are dropped. Raises what `from_pretrained` raises."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vl, info = AutoModelForImageTextToText.from_pretrained(
        str(directory), config=config.hf_file_config(), dtype=dtype, attn_implementation="eager",
        output_loading_info=True)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config.hf_config(), dtype=dtype)
    hf.model = vl.model.language_model
    hf.lm_head = vl.lm_head
    hf.model.config = hf.config
    return hf.eval(), info


def _pad_to(x: torch.Tensor, k: int, fill_from: torch.Tensor | None = None) -> torch.Tensor:
    """Pad int `[B, S, k']` to width `k` with -1 (or, `fill_from`, with its first column:
    a repeated key slot selects nothing new)."""
    if x.shape[-1] >= k:
        return x
    fill = (fill_from[..., :1].expand(*x.shape[:-1], k - x.shape[-1]) if fill_from is not None
            else x.new_full((*x.shape[:-1], k - x.shape[-1]), -1))
    return torch.cat([x, fill], dim=-1)


def _split_trace(name: str, trace: torch.Tensor | None, layers: tuple[int, ...],
                 shape: tuple[int, ...], upper: int) -> dict[int, torch.Tensor] | None:
    """A replay trace `[B, S, L, K]` as {global layer id: `[B, S, K]`}, after checking its
    dtype, shape (layer columns named) and range [-1, upper)."""
    if trace is None:
        return None
    if not layers:
        raise ModelInputError(f"{name} given but the model has no such layers")
    if not isinstance(trace, torch.Tensor) or trace.dtype not in (torch.int32, torch.int64):
        raise ModelInputError(f"{name} must be an int32/int64 tensor {list(shape)}")
    if trace.dim() == 4 and trace.shape[2] != shape[2]:
        raise ModelInputError(f"{name} has {trace.shape[2]} layer columns, the model "
                              f"{shape[2]} ({'MoE' if name == 'routed_experts' else 'indexed'} "
                              f"layers {list(layers)})")
    if tuple(trace.shape) != shape:
        raise ModelInputError(f"{name} must be an int32/int64 tensor {list(shape)}, got "
                              f"{trace.dtype} {list(trace.shape)}")
    if trace.numel() and (int(trace.min()) < -1 or int(trace.max()) >= upper):
        raise ModelInputError(f"{name} values must lie in [-1, {upper}), got "
                              f"[{int(trace.min())}, {int(trace.max())}]")
    return {layer: trace[:, :, j] for j, layer in enumerate(layers)}
