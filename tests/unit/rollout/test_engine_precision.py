"""--engine-dtype auto: bf16 only where the hardware computes it natively (rollout/engines/precision.py)."""
from __future__ import annotations

import pytest
import torch

from replayrl.rollout.engines import precision
from replayrl.rollout.engines.precision import native_dtype, resolve_dtype


def test_explicit_dtypes_pass_through_and_unknown_ones_are_refused():
    assert resolve_dtype("bfloat16") == "bfloat16" and resolve_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="engine-dtype"):
        resolve_dtype("float16")


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "avx512f"}, "float32"),
    ({"avx512f", "avx512_bf16"}, "float32"),  # a bf16 dot product alone is slower here
    ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16"),
    (set(), "float32"),
])
def test_cpu_auto_is_bf16_only_with_amx(monkeypatch, flags, expected):
    monkeypatch.setattr(precision, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert native_dtype("cpu") == expected == resolve_dtype("auto", "cpu")
