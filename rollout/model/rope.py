"""RoPE frequencies of a Hugging Face config: default, linear, YaRN and Llama-3 scaling.

Sources: Su et al. 2021 (RoFormer, default RoPE); Chen et al. 2023 "Extending context window of
large language models via positional interpolation" (linear); Peng et al. 2023 "YaRN: efficient
context window extension" (yarn); Meta's Llama 3.1 release (llama3). The formulas, their float32
arithmetic and the defaults of optional keys follow transformers' `modeling_rope_utils`
(`ROPE_INIT_FUNCTIONS`), checked against it in tests/unit/rollout/test_model_hf_loading.py.

The scaling travels as `ModelConfig.rope_scaling`, a sorted tuple of `(key, value)` pairs of the
config.json `rope_scaling` / `rope_parameters` dict without `rope_theta` (`()` = default RoPE).
Types whose frequencies depend on the sequence length (`dynamic`, `longrope`) or that no Qwen3
checkpoint uses are refused, never approximated.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_frequencies(rope_theta: float, head_dim: int,
                     rope_scaling: tuple[tuple[str, Any], ...]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 `[head_dim // 2]`, attention scaling of cos / sin).

    `rope_scaling` is the canonical form of
    `replayrl.rollout.model.rope_scaling.normalize_rope_scaling`. The default branch is the
    exact expression the embedded model has always used (its weights and figures depend on it).
    """
    dim = head_dim
    p = dict(rope_scaling)
    rope_type = p.get("rope_type", "default")
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (rope_theta ** exponent)
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(p["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, factor, p), 1.0
    return _yarn(rope_theta, dim, factor, p)


def _llama3(inv_freq: torch.Tensor, factor: float, p: dict) -> torch.Tensor:
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, factor: float, p: dict) -> tuple[torch.Tensor, float]:
    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale_of(factor, p["mscale"]) / mscale_of(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale_of(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    old_len = p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)
