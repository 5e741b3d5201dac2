"""A torch tensor received by a process that has not imported torch.

Importing torch costs about two seconds and 180 MiB, so a torch-free actor (the version clock,
a rollout manager relaying samples) must not pay it because a message held a tensor
(docs/design/transport.md#transport-contract). The codec decodes a tensor into a torch tensor only
in a process where torch is already imported, and into a :class:`TensorData` anywhere else.
Encoding a :class:`TensorData` puts the same tensor on the wire again, so a relay forwards
tensors unchanged.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TensorData", "tensor_from_buffer"]


@dataclass(frozen=True)
class TensorData:
    """The dtype, shape and bytes of a tensor, without torch.

    Attributes:
        dtype: torch's dtype name without prefix (``"float32"``, ``"bfloat16"``).
        shape: the tensor's shape (non-negative ints).
        data: its C-order little-endian bytes as a read-only 1-D ``uint8`` array of
            ``prod(shape) * itemsize`` elements (a view of the received frame).
    """

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def numpy(self) -> np.ndarray:
        """The values as a read-only numpy array sharing :attr:`data` (no copy).

        Raises:
            TypeError: ``bfloat16`` (numpy has no such dtype; use :meth:`torch`).
        """
        if self.dtype == "bfloat16":
            raise TypeError("a bfloat16 tensor has no numpy dtype; use TensorData.torch()")
        return self.data.view(np.dtype(self.dtype)).reshape(self.shape)

    def torch(self) -> Any:
        """The values as a torch tensor (imports torch; copies the bytes, so it is writable)."""
        return tensor_from_buffer(self.data, self.dtype, self.shape, inline=True)


def tensor_from_buffer(buf: Any, name: str, shape: list[int] | tuple[int, ...], inline: bool) -> Any:
    """A torch tensor of dtype ``name`` and ``shape`` over ``buf`` (copied when ``inline``:
    msgpack's small ``bytes`` objects may be interned). Imports torch.

    Raises:
        ImportError: torch is not installed.
    """
    import torch

    dtype = getattr(torch, name)
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)  # torch.frombuffer refuses empty buffers
    if inline:
        # Small: copy out of msgpack's immutable (possibly interned, e.g. 1-byte) bytes object.
        return torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)
    if not buf.readonly:  # zmq.Frame and bytearray buffers: the usual case, no warning
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)
    with warnings.catch_warnings():
        # Read-only frame (e.g. ``bytes`` from a copying recv): still shared, not copied, as
        # documented in the module docstring; torch's "buffer is not writable" warning is
        # expected here. catch_warnings is process-global, hence only on this rare path.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)
