"""The canonical form of a config.json RoPE scaling (`normalize_rope_scaling`), without torch.

`ModelConfig` checks its `rope_scaling` with it; the frequencies themselves are
`replayrl.rollout.model.rope` (which re-exports these names). Types whose frequencies depend on
the sequence length (`dynamic`, `longrope`) or that no Qwen3 checkpoint uses are refused.
"""

from __future__ import annotations

from typing import Any

from replayrl.rollout.model.errors import ModelConfigError

SUPPORTED_TYPES = ("default", "linear", "yarn", "llama3")
# keys each type reads (besides rope_type); any other key is refused so no setting is ignored
_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "llama3": frozenset({"factor", "original_max_position_embeddings", "low_freq_factor",
                         "high_freq_factor"}),
}
_REQUIRED = {"default": (), "linear": ("factor",), "yarn": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def normalize_rope_scaling(scaling: Any, max_position_embeddings: int) -> tuple[tuple[str, Any], ...]:
    """The canonical form of a RoPE scaling: sorted `(key, value)` pairs, `()` for default RoPE.

    `scaling`: a config.json dict (`rope_type` or legacy `type`, plus its parameters; a
    `rope_theta` / `partial_rotary_factor` entry is dropped here, the caller reads it), a
    sequence of pairs (the canonical form after a msgpack trip: lists of lists), or None / ().
    `original_max_position_embeddings` defaults to `max_position_embeddings` for yarn / llama3,
    as transformers does.

    Raises `ModelConfigError` naming `rope_scaling.<key>` for an unsupported type, an unknown or
    missing key, or a non-positive factor.
    """
    if not scaling:
        return ()
    d = dict(scaling)
    d.pop("rope_theta", None)
    d.pop("partial_rotary_factor", None)
    rope_type = d.pop("rope_type", d.pop("type", "default"))
    if rope_type not in SUPPORTED_TYPES:
        raise ModelConfigError(f"config.json field 'rope_scaling.rope_type'={rope_type!r} is not "
                               f"supported (supported: {', '.join(SUPPORTED_TYPES)})")
    unknown = sorted(set(d) - _KEYS[rope_type])
    if unknown:
        raise ModelConfigError(f"config.json field 'rope_scaling.{unknown[0]}' is not supported "
                               f"with rope_type {rope_type!r}")
    for key in _REQUIRED[rope_type]:
        if d.get(key) is None:
            raise ModelConfigError(f"config.json field 'rope_scaling.{key}' is required with "
                                   f"rope_type {rope_type!r}")
    if "factor" in d and not float(d["factor"]) > 0:
        raise ModelConfigError(f"config.json field 'rope_scaling.factor'={d['factor']!r} must be > 0")
    if rope_type == "default":
        return ()
    if rope_type in ("yarn", "llama3"):
        d.setdefault("original_max_position_embeddings", max_position_embeddings)
    return tuple(sorted({"rope_type": rope_type, **d}.items()))
