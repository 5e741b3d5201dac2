"""Model configuration: Qwen3 / Qwen3-MoE math plus an optional DSA-style indexer.

Field names are those of Hugging Face transformers' `Qwen3MoeConfig`, so `to_hf_dict()` is a
config.json that transformers, vLLM and SGLang read as `Qwen3MoeForCausalLM` (or as the dense
`Qwen3ForCausalLM` when the model has no experts: a dense Qwen3 is the MoE model with every layer
dense). The indexer fields are replayrl's own and travel in config.json under the
`replayrl_indexer` key, which those loaders ignore. `from_hf_dict` reads both architectures
as transformers writes them and refuses, naming the field, every value the model code does not
implement (docs/design/model.md#hf-checkpoints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from replayrl.rollout.model.errors import ModelConfigError
from replayrl.rollout.model.rope_scaling import normalize_rope_scaling

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
HF_MODEL_TYPE = "qwen3_moe"
# model_type -> architecture class name, for the two architectures the model code implements
HF_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}
INDEXER_KEY = "replayrl_indexer"
_HF_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen3-MoE decoder (HF `Qwen3MoeConfig` field names) plus the indexer.

    Layer kinds follow HF's rule: layer `i` is MoE iff `i not in mlp_only_layers` and
    `num_experts > 0` and `(i + 1) % decoder_sparse_step == 0`; otherwise it is a dense SiLU-gated
    MLP of width `intermediate_size`.

    Indexer (DSA-style, DeepSeek-V3.2 "lightning indexer", simplified): on every layer of
    `index_layers`, when `index_topk > 0`, each query attends only to the `index_topk` causal keys
    with the highest indexer score (see `replayrl.rollout.model.indexer`). `index_topk = 0` turns it off.

    `tie_word_embeddings`: the LM head shares the embedding matrix. `rope_scaling`: the RoPE
    scaling as sorted `(key, value)` pairs (`replayrl.rollout.model.rope`; `()` = default RoPE); a dict
    or a list of pairs is normalised on construction.

    Raises `ModelConfigError` naming the field when a value is out of range or inconsistent.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Lists from JSON become tuples so the config stays hashable and read-only.
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        object.__setattr__(self, "index_layers", tuple(int(i) for i in self.index_layers))
        object.__setattr__(self, "rope_scaling",
                           normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings))
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "decoder_sparse_step",
                     "max_position_embeddings", "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise ModelConfigError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ModelConfigError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts < 0:
            raise ModelConfigError(f"ModelConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ModelConfigError(
                    f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ModelConfigError(
                    f"ModelConfig.moe_intermediate_size must be > 0, got {self.moe_intermediate_size}")
        for name in ("rms_norm_eps", "rope_theta"):
            if not math.isfinite(getattr(self, name)):
                raise ModelConfigError(f"ModelConfig.{name} must be finite, got {getattr(self, name)!r}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ModelConfigError("ModelConfig.rms_norm_eps and rope_theta must be > 0")
        for name in ("mlp_only_layers", "index_layers"):
            ids = getattr(self, name)
            bad = [i for i in ids if not 0 <= i < self.num_hidden_layers]
            if bad or len(set(ids)) != len(ids):
                raise ModelConfigError(
                    f"ModelConfig.{name} must hold distinct layer ids in [0, {self.num_hidden_layers}), "
                    f"got {ids}")
        if self.index_topk < 0:
            raise ModelConfigError(f"ModelConfig.index_topk must be >= 0, got {self.index_topk}")
        if self.index_topk > 0 and (self.index_n_heads <= 0 or self.index_head_dim <= 0
                                    or not self.index_layers):
            raise ModelConfigError(
                "ModelConfig.index_topk > 0 needs index_n_heads > 0, index_head_dim > 0 and a "
                f"non-empty index_layers, got {self.index_n_heads}, {self.index_head_dim}, "
                f"{self.index_layers}")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Global ids of the MoE layers in order; position in this tuple = `L_moe` axis of traces."""
        return tuple(
            i for i in range(self.num_hidden_layers)
            if i not in self.mlp_only_layers and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def indexed_layers(self) -> tuple[int, ...]:
        """Global ids of the layers with an indexer, sorted; `()` when `index_topk == 0`.

        Position in this tuple = `L_idx` axis of `indexer_topk` traces.
        """
        return tuple(sorted(self.index_layers)) if self.index_topk > 0 else ()

    @property
    def hf_model_type(self) -> str:
        """`"qwen3_moe"`, or `"qwen3"` (dense `Qwen3ForCausalLM`) when there are no experts."""
        return HF_MODEL_TYPE if self.num_experts > 0 else "qwen3"

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """Return a Hugging Face config.json dict (`Qwen3MoeForCausalLM`, model_type `qwen3_moe`,
        or `Qwen3ForCausalLM` / `qwen3` for a model without experts).

        `torch_dtype`: one of "float32", "bfloat16", "float16" (the dtype of the stored weights;
        written as both `torch_dtype` and transformers-5's `dtype`). Both the legacy
        `rope_theta` / `rope_scaling` and the transformers-5 `rope_parameters` are written so
        older and newer loaders read the same RoPE. Indexer fields go under `replayrl_indexer`.
        Raises `ModelConfigError` for an unknown dtype.
        """
        if torch_dtype not in _HF_DTYPES:
            raise ModelConfigError(f"torch_dtype must be one of {_HF_DTYPES}, got {torch_dtype!r}")
        scaling = dict(self.rope_scaling)
        d: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[self.hf_model_type]],
            "model_type": self.hf_model_type,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", **scaling, "rope_theta": self.rope_theta},
            "rope_scaling": scaling or None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "initializer_range": 0.02,
            "use_cache": True,
        }
        if self.num_experts > 0:
            d.update({
                "moe_intermediate_size": self.moe_intermediate_size,
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
                "output_router_logits": False,
                "router_aux_loss_coef": 0.0,
            })
        else:
            d["layer_types"] = ["full_attention"] * self.num_hidden_layers
        d[INDEXER_KEY] = {
            "index_topk": self.index_topk,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_layers": list(self.index_layers),
        }
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build a config from a Hugging Face config.json dict of `Qwen3ForCausalLM` (model_type
        `qwen3`, every layer dense) or `Qwen3MoeForCausalLM` (`qwen3_moe`), as transformers 4
        or 5 writes it.

        Reads `num_experts` or transformers-5's `num_local_experts`; `rope_theta` at top level or
        in `rope_parameters`, the scaling from `rope_scaling` or `rope_parameters` (default,
        linear, yarn, llama3: `replayrl.rollout.model.rope`); `head_dim` defaults to hidden_size //
        num_attention_heads, `mlp_only_layers` to (), `decoder_sparse_step` to 1,
        `tie_word_embeddings` to False, the indexer (`replayrl_indexer`) to off.

        Raises `ModelConfigError` naming the field, e.g. `config.json field
        'rope_scaling.rope_type'='dynamic' is not supported`, for another architecture or
        model_type, a value the model code does not implement (activation, attention bias,
        sliding window, partial rotary factor, a RoPE type, a non-full-attention layer type), a
        missing field, or a non-finite number at any depth (e.g. `"rope_theta": 1e400`, which
        `json` reads as inf, or `NaN` / `Infinity`): such a value could not be written back as
        strict JSON (`replayrl.transport.strict_json`) nor mean anything to the model.
        """
        def bad(field: str, value: Any, why: str = "is not supported") -> ModelConfigError:
            return ModelConfigError(f"config.json field {field!r}={value!r} {why}")

        for field, value in _non_finite(d):
            raise bad(field, value, "is not finite")

        model_type = d.get("model_type")
        if model_type not in HF_ARCHITECTURES:
            # the families load through their own classes; the message names them too, so that a
            # user who reads it knows every model_type --hf-checkpoint takes
            from replayrl.rollout.model.families import FAMILIES
            raise bad("model_type", model_type,
                      f"is not supported (supported: {', '.join(sorted(HF_ARCHITECTURES))} on the "
                      f"embedded model; {', '.join(sorted(FAMILIES))} as model families)")
        archs = d.get("architectures") or [HF_ARCHITECTURES[model_type]]
        if list(archs) != [HF_ARCHITECTURES[model_type]]:
            raise bad("architectures", archs, f"is not supported with model_type {model_type!r} "
                      f"(expected [{HF_ARCHITECTURES[model_type]!r}])")
        # attention_dropout: the model has no dropout, so a nonzero one would train another model
        for field, ok in (("hidden_act", "silu"), ("attention_bias", False),
                          ("use_sliding_window", False), ("mlp_bias", False),
                          ("attention_dropout", 0.0)):
            if d.get(field, ok) not in (ok, None):
                raise bad(field, d[field])
        for i, kind in enumerate(d.get("layer_types") or ()):
            if kind != "full_attention":
                raise bad(f"layer_types[{i}]", kind)
        rope = dict(d.get("rope_parameters") or {})
        legacy = d.get("rope_scaling")
        if legacy and rope and any(rope.get(k, v) != v for k, v in legacy.items()
                                   if k not in ("type", "rope_type")):
            raise bad("rope_scaling", legacy, f"disagrees with rope_parameters {rope!r}")
        scaling = {**rope, **(legacy or {})}
        prf = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if prf not in (1, 1.0, None):
            raise bad("partial_rotary_factor", prf)
        rope_theta = d.get("rope_theta", rope.get("rope_theta"))
        if rope_theta is None:
            raise ModelConfigError("config.json lacks rope_theta (top level or in rope_parameters)")

        def need(key: str) -> Any:
            if key not in d or d[key] is None:
                raise ModelConfigError(f"config.json lacks required field {key!r}")
            return d[key]

        if model_type == "qwen3":
            for field in ("num_experts", "num_local_experts"):
                if d.get(field):
                    raise bad(field, d[field], "is not supported with model_type 'qwen3' (dense)")
            moe = {"moe_intermediate_size": 0, "num_experts": 0, "num_experts_per_tok": 0,
                   "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": ()}
        else:
            experts = d.get("num_experts", d.get("num_local_experts"))
            if experts is None:
                raise ModelConfigError("config.json lacks required field 'num_experts' "
                                       "(or 'num_local_experts')")
            moe = {"moe_intermediate_size": int(need("moe_intermediate_size")),
                   "num_experts": int(experts),
                   "num_experts_per_tok": int(need("num_experts_per_tok")),
                   "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
                   "decoder_sparse_step": int(d.get("decoder_sparse_step") or 1),
                   "mlp_only_layers": tuple(d.get("mlp_only_layers") or ())}

        idx = d.get(INDEXER_KEY) or {}
        try:
            return cls(
                vocab_size=int(need("vocab_size")),
                hidden_size=int(need("hidden_size")),
                intermediate_size=int(need("intermediate_size")),
                num_hidden_layers=int(need("num_hidden_layers")),
                num_attention_heads=int(need("num_attention_heads")),
                num_key_value_heads=int(d.get("num_key_value_heads") or need("num_attention_heads")),
                head_dim=int(d.get("head_dim") or need("hidden_size") // need("num_attention_heads")),
                rms_norm_eps=float(need("rms_norm_eps")),
                rope_theta=float(rope_theta),
                rope_scaling=tuple(scaling.items()),
                max_position_embeddings=int(need("max_position_embeddings")),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                index_topk=int(idx.get("index_topk", 0)),
                index_n_heads=int(idx.get("index_n_heads", 0)),
                index_head_dim=int(idx.get("index_head_dim", 0)),
                index_layers=tuple(idx.get("index_layers", ())),
                **moe,
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"config.json holds a value of the wrong type: {exc}") from None


def _non_finite(obj: Any, path: str = ""):
    """Yield ``(key path, value)`` of every non-finite float in nested dicts / lists, in order
    (paths as ``rope_parameters.rope_theta``, ``layer_types[2]``)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        yield path or "<top level>", obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _non_finite(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _non_finite(value, f"{path}[{i}]")


def default_config(vocab_size: int) -> ModelConfig:
    """The embedded default: ~1M parameters, small enough for RL on 2 CPU cores.

    4 layers (layer 0 dense via mlp_only_layers=(0,), layers 1-3 MoE with 8 experts, top-2,
    renormalised), hidden 128, 4 query heads x head_dim 32 (vLLM's CPU attention kernels need
    head_dim >= 32), 2 KV heads, indexer keeping 8 keys per query on layers 1 and 3.
    """
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(0,),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        index_topk=8,
        index_n_heads=2,
        index_head_dim=16,
        index_layers=(1, 3),
    )


# named sizes of the embedded model (--model-size); "1m" is default_config unchanged
MODEL_SIZES = ("1m", "10m", "50m")


def embedded_config(vocab_size: int, size: str = "1m", min_positions: int = 0) -> ModelConfig:
    """The embedded model at a named size (``--model-size``), all Qwen3-MoE with the indexer.

    * ``"1m"``: :func:`default_config` (913,280 parameters with the 44-token embedded vocabulary).
    * ``"10m"``: hidden 256, 6 layers (layer 0 dense, intermediate 1024; layers 1-5 MoE, 8 experts
      of width 256, top-2), 8 query heads x head_dim 32, 4 KV heads, indexer (2 heads x 16,
      top-8 keys) on layers 1, 3, 5: 9,905,280 parameters at 44 tokens.
    * ``"50m"``: hidden 512, 7 layers (layer 0 dense, intermediate 2048; layers 1-6 MoE, 8 experts
      of width 512, top-2), 8 query heads x head_dim 64, 4 KV heads, indexer (4 heads x 32, top-8)
      on layers 1, 3, 5: 46,729,600 parameters at 44 tokens.

    ``max_position_embeddings`` is the preset's 256, or ``min_positions`` when that is larger (a
    run whose answers need more positions; default RoPE does not depend on it, so the weights
    and the function are the same).

    Raises:
        ModelConfigError: ``size`` is not one of :data:`MODEL_SIZES`.
    """
    base = default_config(vocab_size)
    if size == "1m":
        cfg = base
    elif size == "10m":
        cfg = replace(base, hidden_size=256, intermediate_size=1024, moe_intermediate_size=256,
                      num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=32, index_layers=(1, 3, 5))
    elif size == "50m":
        cfg = replace(base, hidden_size=512, intermediate_size=2048, moe_intermediate_size=512,
                      num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64, index_n_heads=4, index_head_dim=32, index_layers=(1, 3, 5))
    else:
        raise ModelConfigError(f"model size must be one of {', '.join(MODEL_SIZES)}, got {size!r}")
    if min_positions > cfg.max_position_embeddings:
        cfg = replace(cfg, max_position_embeddings=int(min_positions))
    return cfg



def without_indexer(config: ModelConfig) -> ModelConfig:
    """``config`` with the indexer off (``index_topk = 0``, no indexer heads or layers).

    The indexer-free variant is a plain Qwen3-MoE that external engines (vLLM, SGLang) serve
    as it is: their ``Qwen3MoeForCausalLM`` has no indexer layer, so on a model with one they
    would compute dense attention there, i.e. another policy (docs/design/engines.md#engines).
    """
    return replace(config, index_topk=0, index_n_heads=0, index_head_dim=0, index_layers=())
