"""CUDA -> CPU compatibility layer that lets megatron-core 0.16.1 run on CPU with gloo.

megatron-core assumes a GPU in a handful of places even with the local (non-TransformerEngine)
layer spec and ``use_cpu_initialization=True``. Each item below is one such place, measured on
megatron-core 0.16.1 with torch 2.13.0 CPU, and tests/system/test_megatron_cpu_compat.py shows for
every item that switching it off gives the named failure (docs/design/megatron.md#megatron-backend). The
layer is applied by :func:`enable` for the CPU device the backend trains on (``--device cpu``,
also on a machine with CUDA); for a CUDA device it would do nothing and leave megatron-core
unmodified, but the backend's CUDA placement is not written (docs/gpu.md), so its run check
refuses CUDA.

Items (:data:`ITEMS`):

* ``current_device`` -- ``torch.cuda.current_device()`` (used as the ``device=`` of router,
  expert and gradient-buffer allocations) returns the CPU device instead of raising
  "Torch not compiled with CUDA enabled".
* ``rng_tracker`` -- ``model_parallel_cuda_manual_seed`` and the tracker's ``fork()`` (entered by
  every attention forward) keep their named RNG states as CPU generator states; the CUDA
  tracker raises in ``torch.cuda.get_rng_state``.
* ``streams`` -- ``torch.cuda.Stream`` / ``Event`` / ``stream()`` / ``current_stream()`` /
  ``default_stream()`` are inert stand-ins (CPU work is ordered anyway); the MoE all-to-all
  dispatcher creates a stream when it is built.
* ``cuda_allocations`` -- tensors created with ``device="cuda"`` (gradient clipping's norm and
  overflow buffers) are created on the CPU, by a torch function mode entered around every
  megatron call (:func:`cpu_device_scope`).
* ``param_type`` -- inside the same mode, ``Tensor.type()`` of a float32 / bf16 / fp16 CPU
  tensor answers its ``torch.cuda.*`` name, which is what the gradient clipping and the
  (distributed) optimizer assert before accepting a parameter.
* ``te_general_gemm`` -- ``megatron.core.transformer.moe.moe_utils`` refers to
  ``te_general_gemm`` in the router's gating linear although it is only imported when
  TransformerEngine is installed (NameError otherwise); set to ``None``, the torch path runs.
* ``alltoall_split_sizes`` -- the expert-parallel all-to-all passes its split sizes as numpy /
  tensor values; gloo's ``all_to_all_single`` takes Python ints only.
* ``sp_layernorm`` -- the local (torch) norm asserts ``not sequence_parallel``; under sequence
  parallelism it is built as usual and its weights are marked ``sequence_parallel`` so that
  megatron's ``finalize_model_grads`` sums their gradients over the tensor-parallel group.
* ``cp_rotary`` -- under context parallelism the rotary embedding takes its CP rank's two
  chunks of the table (``get_pos_emb_on_this_cp_rank``) with an index tensor built with
  ``pin_memory=True`` and moved by ``.cuda()``; the same selection with a CPU index tensor
  (docs/design/megatron.md#context-parallel).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from replayrl.trainer.errors import CompatError

__all__ = ["ITEMS", "enable", "enabled_items", "cpu_device_scope"]

ITEMS = ("current_device", "rng_tracker", "streams", "cuda_allocations", "param_type",
         "te_general_gemm", "alltoall_split_sizes", "sp_layernorm", "cp_rotary")
"""Names of the compatibility items, in the order :func:`enable` applies them."""

_ENABLED: set[str] = set()
_SKIPPED: set[str] = set()  # switched off for the life of the process (tests only)


# --------------------------------------------------------------------------- streams / events


class _CpuStream:
    """Inert stand-in for ``torch.cuda.Stream`` (CPU ops run in program order)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        """No-op: nothing to wait for on the CPU."""

    def wait_event(self, event) -> None:
        """No-op: nothing to wait for on the CPU."""

    def record_event(self, event=None):
        """Returns an inert event."""
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always finished."""
        return True


class _CpuEvent:
    """Inert stand-in for ``torch.cuda.Event``."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        """No-op."""

    def wait(self, stream=None) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always finished."""
        return True


_DEFAULT_STREAM = _CpuStream()


def _stream_context(stream=None):
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- RNG tracker


def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mp_random

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """megatron's named RNG states kept as CPU generator states (``torch.get_rng_state``)."""

        def add(self, name, seed):
            """Track a new named state seeded with ``seed`` (megatron's contract)."""
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            """Run the block with the CPU generator in state ``name``, then restore it."""
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


# --------------------------------------------------------------------------- device mode

_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor",
                    torch.float16: "torch.cuda.HalfTensor"}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CpuDeviceMode(TorchFunctionMode):
    """Redirects ``device="cuda"`` to the CPU and answers ``Tensor.type()`` with CUDA names."""

    def __init__(self, allocations: bool, param_type: bool) -> None:
        super().__init__()
        self.allocations, self.param_type = allocations, param_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.allocations and "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if (self.param_type and func is torch.Tensor.type and len(args) == 1 and not kwargs
                and args[0].device.type == "cpu" and args[0].dtype in _CUDA_TYPE_NAMES):
            return _CUDA_TYPE_NAMES[args[0].dtype]
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_scope() -> Iterator[None]:
    """Enter around every megatron-core call: the ``cuda_allocations`` / ``param_type`` items.

    A no-op when neither item is enabled (a CUDA machine, or both switched off).
    """
    allocations, param_type = "cuda_allocations" in _ENABLED, "param_type" in _ENABLED
    if not (allocations or param_type):
        yield
        return
    with _CpuDeviceMode(allocations, param_type):
        yield


# --------------------------------------------------------------------------- all-to-all / norm


def _int_splits(sizes):
    if sizes is None:
        return None
    if isinstance(sizes, torch.Tensor):
        return [int(s) for s in sizes.tolist()]
    return [int(s) for s in sizes]


def _patch_all_to_all() -> None:
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    original = mappings.all_to_all

    @functools.wraps(original)
    def all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None):
        return original(group, input_, _int_splits(output_split_sizes), _int_splits(input_split_sizes))

    mappings.all_to_all = all_to_all
    token_dispatcher.all_to_all = all_to_all


def _patch_sp_norm() -> None:
    import dataclasses

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        norm = original(cls, dataclasses.replace(config, sequence_parallel=False), hidden_size,
                        eps, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True  # finalize_model_grads sums these grads over TP
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__


def _patch_cp_rotary() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        """megatron-core 0.16.1's ``rope_utils.get_pos_emb_on_this_cp_rank`` with the index
        tensor on the table's device: chunks ``r`` and ``2c - 1 - r`` of ``2c`` along ``seq_dim``."""
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        size, rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, index)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


# --------------------------------------------------------------------------- enable


def enabled_items() -> tuple[str, ...]:
    """Items applied in this process so far, in :data:`ITEMS` order."""
    return tuple(i for i in ITEMS if i in _ENABLED)


def enable(skip: Iterable[str] = (), device: str = "cpu") -> tuple[str, ...]:
    """Apply every item of :data:`ITEMS` except ``skip`` (process-wide, idempotent).

    Does nothing for a CUDA ``device`` (the megatron backend trains on the CPU: its run check
    refuses CUDA, docs/gpu.md); on a machine with CUDA the items apply as well, since the
    backend's process then still computes on the CPU (``--device cpu``). ``skip`` exists for
    the tests that show each item is needed; a run never skips any. A skipped item stays off
    for the life of the process (a later call without ``skip``, e.g. from the backend's setup,
    does not apply it).

    Returns:
        the items applied in this process.

    Raises:
        CompatError: an unknown name in ``skip``, or ``skip`` names an item already applied.
    """
    skip = set(skip)
    unknown = skip - set(ITEMS)
    if unknown:
        raise CompatError(f"unknown megatron CPU compat items {sorted(unknown)}; known: {ITEMS}")
    if skip & _ENABLED:
        raise CompatError(f"items {sorted(skip & _ENABLED)} were already applied in this process")
    if torch.device(device).type == "cuda":
        return enabled_items()
    _SKIPPED.update(skip)
    for item in ITEMS:
        if item in _SKIPPED or item in _ENABLED:
            continue
        _APPLY[item]()
        _ENABLED.add(item)
    return enabled_items()


def _apply_current_device() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")


def _apply_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.CudaRNGStatesTracker = _cpu_tracker_class()


def _apply_streams() -> None:
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.stream = _stream_context
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    torch.cuda.default_stream = lambda device=None: _DEFAULT_STREAM


def _apply_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_APPLY = {
    "current_device": _apply_current_device,
    "rng_tracker": _apply_rng_tracker,
    "streams": _apply_streams,
    "cuda_allocations": lambda: None,  # applied by cpu_device_scope
    "param_type": lambda: None,        # applied by cpu_device_scope
    "te_general_gemm": _apply_te_general_gemm,
    "alltoall_split_sizes": _patch_all_to_all,
    "sp_layernorm": _patch_sp_norm,
    "cp_rotary": _patch_cp_rotary,
}
