"""The device a process computes on: ``--device auto|cpu|cuda`` resolved for this machine and
this process.

Each decision is a function of its inputs, so CI tests every outcome on a CPU machine and only
:func:`process_device` reads the machine:

- :func:`resolve_device_kind`: ``auto`` is ``cuda`` where torch sees a CUDA device, else ``cpu``;
  ``cuda`` where there is none is refused (:class:`replayrl.actors.errors.DeviceError`), before
  any actor starts (the launcher resolves it in its initial-files child);
- :func:`device_index`: a process's CUDA device among the visible ones, ``LOCAL_RANK`` modulo
  their count (under torchrun with ``CUDA_VISIBLE_DEVICES=$LOCAL_RANK`` one is visible: index 0;
  the single-node launcher gives each actor process one visible device the same way,
  :func:`cuda_slots`);
- :func:`compute_dtype`: bf16 compute (autocast over fp32 master weights) where the device has
  it, else fp32;
- :func:`pins_host_memory`: page-locked host buffers only for a CUDA device (an asynchronous
  copy needs them; on the CPU they would only cost).

Torch is imported inside the functions that need it: the run's settings load without it.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Sequence

from replayrl.actors.errors import DeviceError

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICES", "compute_dtype", "cuda_absent_reason", "cuda_slots", "device_index", "pins_host_memory",
           "process_device", "resolve_device_kind"]

DEVICES = ("auto", "cpu", "cuda")
"""What ``--device`` accepts."""


def resolve_device_kind(name: str, cuda_available: bool, why_absent: str = "") -> str:
    """``"cpu"`` or ``"cuda"``: ``name`` itself, or for ``"auto"`` CUDA where available.

    Args:
        name: one of :data:`DEVICES`.
        cuda_available: whether this machine's torch sees a CUDA device
            (``torch.cuda.is_available()``).
        why_absent: appended to the refusal (e.g. the torch build), when CUDA is absent.
    Raises:
        DeviceError: ``name`` is not one of :data:`DEVICES`, or is ``"cuda"`` while
            ``cuda_available`` is False.
    """
    if name not in DEVICES:
        raise DeviceError(f"--device must be one of {DEVICES}, got {name!r}")
    if name == "auto":
        return "cuda" if cuda_available else "cpu"
    if name == "cuda" and not cuda_available:
        raise DeviceError("--device cuda, but torch sees no CUDA device"
                          + (f" ({why_absent})" if why_absent else "")
                          + "; use --device cpu or auto")
    return name


def cuda_absent_reason() -> str:
    """Why ``torch.cuda.is_available()`` is False here, in words: a CPU-only torch build, or a
    CUDA build that finds no device (empty when CUDA is available)."""
    import torch

    if torch.cuda.is_available():
        return ""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no device{shown}"


def device_index(local_rank: int, visible: int) -> int:
    """The CUDA device index of a process: ``local_rank`` modulo the ``visible`` devices.

    Raises:
        DeviceError: ``visible < 1`` or ``local_rank < 0``.
    """
    if visible < 1:
        raise DeviceError(f"no CUDA device visible to this process (LOCAL_RANK {local_rank})")
    if local_rank < 0:
        raise DeviceError(f"LOCAL_RANK must be >= 0, got {local_rank}")
    return local_rank % visible


def process_device(name: str, env: Mapping[str, str] | None = None) -> "torch.device":
    """This process's device for ``--device name``: the CPU, or its CUDA device
    (:func:`device_index` of ``LOCAL_RANK``, default 0, among the visible devices), made the
    current CUDA device (``torch.cuda.set_device``).

    Args:
        name: one of :data:`DEVICES` (a device already resolved to ``"cpu"`` / ``"cuda"`` too).
        env: the environment to read ``LOCAL_RANK`` from (default ``os.environ``).
    Raises:
        DeviceError: as :func:`resolve_device_kind`, or a ``LOCAL_RANK`` that is no integer.
    """
    import torch

    kind = resolve_device_kind(name, torch.cuda.is_available(),
                               "" if name != "cuda" else cuda_absent_reason())
    if kind == "cpu":
        return torch.device("cpu")
    env = os.environ if env is None else env
    try:
        local_rank = int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        raise DeviceError(f"LOCAL_RANK must be an integer, got {env.get('LOCAL_RANK')!r}") from None
    device = torch.device("cuda", device_index(local_rank, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


def compute_dtype(device: "torch.device", bf16_supported: bool | None = None) -> "torch.dtype | None":
    """The autocast dtype of a trainer forward on ``device``: ``torch.bfloat16`` on a CUDA device
    that computes bf16 (``torch.cuda.is_bf16_supported()``, or ``bf16_supported`` when given),
    else None: float32 throughout, as on the CPU (where a bf16 autocast would change every
    number of a run without making it faster on most CPUs; docs/gpu.md)."""
    import torch

    if device.type != "cuda":
        return None
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16_supported else None


def pins_host_memory(device: "torch.device") -> bool:
    """Whether host buffers that feed ``device`` should be page-locked: only for a CUDA device,
    whose copies from / to pinned memory can be asynchronous (``non_blocking``); on the CPU a
    pinned buffer gives nothing (and a CPU-only torch cannot pin)."""
    return device.type == "cuda"


def cuda_slots(trainers: Sequence[str], engines: Sequence[str], count: int,
               shared: Sequence[str] = ()) -> dict[str, int]:
    """Which of ``count`` visible CUDA devices each actor process of one node gets: trainer
    rank ``r`` device ``r``, engine ``i`` device ``len(trainers) + i``, both modulo ``count``
    (so one GPU holds them all, and ``T + E`` GPUs one each); the actors of ``shared`` (one
    colocated process) take the first trainer's device.

    Args:
        trainers, engines: actor names, in rank / index order.
        count: visible CUDA devices, ``>= 1``.
        shared: actors that share one process with ``trainers[0]``.
    Returns:
        actor name -> device index in ``0 .. count - 1``.
    Raises:
        DeviceError: ``count < 1``.
    """
    if count < 1:
        raise DeviceError(f"no CUDA device to place {len(trainers) + len(engines)} actors on")
    slots = {name: i % count for i, name in enumerate([*trainers, *engines])}
    if trainers:
        slots.update({name: slots[trainers[0]] for name in shared if name in slots})
    return slots
