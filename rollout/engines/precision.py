"""``--engine-dtype auto``: the engine precision the hardware computes natively.

bfloat16 halves weight and KV-cache bytes, but only pays where the arithmetic itself runs in
bf16: CUDA GPUs with bf16 tensor cores (compute capability >= 8, ``torch.cuda.is_bf16_supported``)
and CPUs with AMX tiles (``amx_bf16``, Intel Sapphire Rapids and later). Elsewhere torch
converts to float32 around every operation. AVX512_BF16 alone (only a dot-product instruction)
does not count: on the 2-core AMD EPYC development machines, which have it, the embedded
engine generates ~1.3x slower in bf16 than in float32 (same run, median of 15 batches of 128
prompts). bf16 against the fp32 trainer stays measured by ``replayrl bench parity``.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "native_dtype", "resolve_dtype"]

DTYPES = ("auto", "bfloat16", "float32")
"""What ``--engine-dtype`` accepts."""


def _cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def native_dtype(device: str | torch.device = "cpu") -> str:
    """``"bfloat16"`` where ``device`` computes bf16 natively (module docstring), else ``"float32"``."""
    import torch  # here, not at module level: the run's settings (DTYPES) load without torch

    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    amx = "AMX" in torch.backends.cpu.get_cpu_capability().upper() or "amx_bf16" in _cpu_flags()
    return "bfloat16" if device.type == "cpu" and amx else "float32"


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> str:
    """``name`` itself, or :func:`native_dtype` of ``device`` for ``"auto"``.

    Raises:
        ValueError: ``name`` is not one of :data:`DTYPES`.
    """
    if name not in DTYPES:
        raise ValueError(f"--engine-dtype must be one of {DTYPES}, got {name!r}")
    return native_dtype(device) if name == "auto" else name
