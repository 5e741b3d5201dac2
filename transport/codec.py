"""msgpack codec with out-of-band array frames.

One message is a list of frames: frame 0 is a msgpack header, frames 1.. are raw array buffers
(docs/design/transport.md#transport-contract). The scheme follows vLLM's ``vllm/v1/serial_utils.py``
(msgpack ext types for tensors, auxiliary buffers for large ones); the code here is our own and
uses ``msgpack`` (not msgspec).

Wire format
-----------
Plain values map to msgpack types: ``None``, ``bool``, ``int`` (64-bit signed or unsigned),
``float`` (float64), ``str``, ``bytes``, ``list``, ``dict`` with ``str`` or ``int`` keys. Four
ext types carry the rest:

====  ==================  ===========================================================
code  Python value        ext payload (itself msgpack)
====  ==================  ===========================================================
1     ``numpy.ndarray``   ``[dtype name, shape, data]``
2     ``torch.Tensor``    ``[dtype name, shape, data]``
3     numpy scalar        ``[dtype name, raw little-endian bytes]``
4     ``tuple`` marker    empty; only valid as the first element of a msgpack array,
                          which then decodes as the tuple of the remaining elements
====  ==================  ===========================================================

Tuples are marked inside the array rather than wrapped in an ext payload because a wrapped
payload needs one nested ``unpackb`` per level, each taking ~40 KB of C stack in msgpack: deep
nesting would overflow the thread's stack instead of raising.

``dtype name`` is numpy's / torch's name without prefix (``"float32"``, ``"bfloat16"``), ``shape``
a list of non-negative ints, and ``data`` either the C-order little-endian bytes inline (when the
array has fewer than ``inline_threshold`` bytes) or the int index ``i >= 1`` of the frame holding
them. bfloat16 travels as its raw 2-byte words. Every frame 1.. is referenced by exactly one array.

No pickle anywhere: an unknown type is an :class:`EncodeError`, an unknown ext code (including
msgpack's built-in timestamp, -1) a :class:`DecodeError`.

A torch tensor decodes to a ``torch.Tensor`` in a process that already imported torch and to a
:class:`replayrl.transport.tensor_data.TensorData` (dtype, shape, read-only bytes) anywhere else, which
re-encodes as the same tensor: decoding never imports torch.

Limits on what a received message may cost (docs/design/transport.md#transport-contract), each
refused with :class:`MessageTooLarge` before the work is done: all frames together and each
array at most ``max_message_bytes``; at most ``max_frames`` frames; at most
``max_container_len`` elements per list / dict; and a work budget of ``decode_budget_floor +
decode_budget_per_byte x header bytes`` units, a decoded list costing
:data:`CONTAINER_UNITS` and each element one, a dict :data:`DICT_UNITS` and each item
:data:`DICT_ITEM_UNITS`. One ``0x90`` byte is an empty list of 56 bytes
in CPython; without the budget a 1 MiB header of them decoded to ~75 MiB. Array shapes are
checked as numpy checks them (the product of the non-zero dimensions times the item size fits
in ``np.intp``), for torch tensors too. Error messages quote hostile values cut short.

Memory and lifetime
-------------------
* Encoding an out-of-band array does not copy it (a non-contiguous or big-endian array is first
  copied once into a C-contiguous little-endian one): the frame is a ``memoryview`` of the array's
  memory, so the frames of ``encode(x)`` change when ``x`` does. The sockets copy such frames
  when a message is sent (``replayrl.transport.sockets.owned_frames``): a write after ``send`` returned
  cannot reach the message; a write between ``encode`` and ``send`` does.
* Decoding builds arrays over the received frames without copying (``np.frombuffer`` /
  ``torch.frombuffer``). Decoded numpy arrays are read-only (``flags.writeable`` is False); copy
  one to modify it. Decoded torch tensors share the frame's memory and are writable (torch has no
  read-only tensors); writing to one writes into the received frame, which nothing else uses.
  If a frame was given as a read-only buffer (``bytes``), the tensor still aliases it: do not
  write to such a tensor.
  Inline tensors are copied out of the header (they are small), so they never alias msgpack's
  immutable ``bytes`` objects. If you decode frames that alias live objects (``decode(encode(x))``
  in one process), the decoded arrays alias ``x``.
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

import msgpack
import numpy as np
import zmq

from replayrl.transport.errors import DecodeError, EncodeError, MessageTooLarge, TransportError
from replayrl.transport.shm_pool import ShmHeader, ShmPool, ShmReader
from replayrl.transport.tensor_data import TensorData, tensor_from_buffer

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_ALLOWED_DTYPES",
    "DEFAULT_MAX_FRAMES",
    "DEFAULT_MAX_CONTAINER_LEN",
    "CodecConfig",
    "Codec",
    "encode",
    "decode",
]

# The wire is little-endian and decoding is zero copy, so a big-endian host would have to byte
# swap every array; no supported platform is big-endian, so refuse rather than carry that path.
if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("replayrl.transport.codec requires a little-endian host")

DEFAULT_INLINE_THRESHOLD = 16 * 1024
"""Arrays with fewer bytes than this travel inline in frame 0. pyzmq copies frames under 64 KiB
anyway and inline was measured 1.6x faster at 4 KiB (docs/design/transport.md#transport-contract); unit: bytes."""

DEFAULT_MAX_MESSAGE_BYTES = 1 << 31
"""Largest accepted message, all frames together (and largest single array); unit: bytes."""

DEFAULT_MAX_FRAMES = 1 << 16
"""Most frames in one message (header included), so also at most this many out-of-band arrays:
enough for one weight push of a model with tens of thousands of tensors."""

DEFAULT_MAX_CONTAINER_LEN = 1 << 20
"""Most elements of one msgpack array or map (msgpack's ``max_array_len`` / ``max_map_len``)."""

DEFAULT_DECODE_BUDGET_PER_BYTE = 2
DEFAULT_DECODE_BUDGET_FLOOR = 1 << 16
"""Decoder work budget of a header of ``n`` bytes: ``floor + per_byte * n`` units, where a
decoded list / dict / tuple costs :data:`CONTAINER_UNITS` and each of its elements one unit
(an 8-byte slot). A unit stands for about 8 bytes of Python memory, so the containers of a
message decode to at most ``8 * (floor + per_byte * n)`` bytes, 16x its header plus 0.5 MiB
(docs/design/transport.md#transport-contract)."""

CONTAINER_UNITS = 8
"""Budget units of one decoded list or tuple: an empty list is 56 bytes of CPython memory,
about eight 8-byte slots, although it is one byte (``0x90``) on the wire."""

DICT_UNITS, DICT_ITEM_UNITS = 24, 3
"""Budget units of one decoded dict and of each of its items: a small dict is 180-230 bytes of
CPython memory (its hash table), an item a hash, a key and a value slot."""

_NUMPY_DTYPE_NAMES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
)
DEFAULT_ALLOWED_DTYPES = frozenset(_NUMPY_DTYPE_NAMES + ("bfloat16",))
"""dtype names accepted by default; ``bfloat16`` only for torch tensors (numpy has none)."""

_TORCH_ONLY_DTYPES = frozenset({"bfloat16"})
# np.dtype.name is computed in Python (~4 us); native-order dtypes map to names through this.
_NUMPY_NAME = {np.dtype(n): n for n in _NUMPY_DTYPE_NAMES}
_KNOWN_DTYPES = DEFAULT_ALLOWED_DTYPES

_EXT_NDARRAY = 1
_EXT_TENSOR = 2
_EXT_NUMPY_SCALAR = 3
_EXT_TUPLE = 4

# Nesting bound for both directions: deeper structures (or cycles) raise a typed error, well
# inside msgpack's own limits (511 levels when packing, 1024 when unpacking).
_MAX_DEPTH = 256
_MAX_NDIM = 64  # numpy's limit; a longer shape is malformed, not just large
# msgpack's default 256 KiB pack buffer is allocated per Packer; nesting two of them (header and
# array payload) made glibc mmap/munmap and fault it on every message (34 us for a 4 KiB array).
# Start small; the buffer grows when a message needs it.
_PACK_BUF = 4096

_TUPLE_MARKER_EXT = msgpack.ExtType(_EXT_TUPLE, b"")


class _TupleMarker:
    """What ext code 4 decodes to before ``list_hook`` turns its array into a tuple; seeing
    one anywhere else in a decoded message means the message is malformed."""

    __slots__ = ()


_TUPLE_MARKER = _TupleMarker()

_PLAIN_LEAVES = frozenset({type(None), bool, int, float, str, bytes})
_CONTAINERS = frozenset({list, tuple, dict})
_KEY_TYPES = frozenset({str, int})


@dataclass(frozen=True)
class CodecConfig:
    """Limits and policy of a :class:`Codec`.

    Attributes:
        inline_threshold: arrays with ``nbytes < inline_threshold`` go inline in frame 0, larger
            ones become their own frame; bytes, >= 0 (0 sends every array out of band).
        max_message_bytes: largest message accepted by ``decode`` (sum of all frame lengths) and
            produced by ``encode``, also the largest single array; bytes, > 0.
        allowed_dtypes: dtype names that may be encoded or decoded; a subset of
            :data:`DEFAULT_ALLOWED_DTYPES`.
        max_frames: most frames of one message, header included; > 0.
        max_container_len: most elements of one decoded list / tuple / dict; > 0.
        decode_budget_per_byte, decode_budget_floor: the decoder's work budget (see
            :data:`DEFAULT_DECODE_BUDGET_FLOOR`); >= 0.

    Raises:
        TransportError: on a negative threshold, non-positive size limit or
            an unknown dtype name.
    """

    inline_threshold: int = DEFAULT_INLINE_THRESHOLD
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    allowed_dtypes: frozenset[str] = field(default=DEFAULT_ALLOWED_DTYPES)
    max_frames: int = DEFAULT_MAX_FRAMES
    max_container_len: int = DEFAULT_MAX_CONTAINER_LEN
    decode_budget_per_byte: int = DEFAULT_DECODE_BUDGET_PER_BYTE
    decode_budget_floor: int = DEFAULT_DECODE_BUDGET_FLOOR

    def __post_init__(self) -> None:
        if type(self.inline_threshold) is not int or self.inline_threshold < 0:
            raise TransportError(f"CodecConfig.inline_threshold must be an int >= 0, got {self.inline_threshold!r}")
        for name in ("max_message_bytes", "max_frames", "max_container_len"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise TransportError(f"CodecConfig.{name} must be an int > 0, got {value!r}")
        for name in ("decode_budget_per_byte", "decode_budget_floor"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise TransportError(f"CodecConfig.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.allowed_dtypes, frozenset):
            raise TransportError(
                f"CodecConfig.allowed_dtypes must be a frozenset, got {type(self.allowed_dtypes).__name__}"
            )
        unknown = self.allowed_dtypes - _KNOWN_DTYPES
        if unknown:
            raise TransportError(
                f"CodecConfig.allowed_dtypes has unsupported dtypes {sorted(unknown)}; "
                f"supported: {sorted(_KNOWN_DTYPES)}"
            )


def _type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _path_str(path: tuple) -> str:
    return "message" + "".join(f"[{k!r}]" for k in path)


def _torch():
    # torch is imported lazily: a process that never made a tensor cannot be sending one, and
    # importing torch costs about a second.
    return sys.modules.get("torch")


def _pairs(node: Any) -> Any:
    return node.items() if type(node) is dict else enumerate(node)


_SMALL_CONTAINER = 16  # below this a plain loop beats building a set of element types


def _first_fault(obj: Any, bad_leaf: Callable[[type], bool], max_depth: int = _MAX_DEPTH) -> tuple | None:
    """The one container walk of the codec: the first structural fault of ``obj``, or None.

    Walks dicts, lists and tuples (not arrays: they are leaves) and reports a container nested
    ``max_depth`` or more deep (cycles included) as ``("depth", None)``, a dict key that is not
    ``str``/``int`` as ``("key", key)``, and a leaf type for which ``bad_leaf(type)`` is true as
    ``("leaf", type)``; plain msgpack leaves (None, bool, int, float, str, bytes) are always
    fine. The encoder passes "not an array / tensor / numpy scalar", the decoder "a msgpack
    timestamp or a stray tuple marker"; each turns the fault into its own error.

    Cost is O(container elements), at C speed for large containers (``set(map(type, ...))``);
    bulk numbers should travel as arrays, which are not walked. No key paths are kept (see
    :func:`_explain_unencodable` for the encoder's message).
    """
    t = type(obj)
    if t in _PLAIN_LEAVES:
        return None
    if t not in _CONTAINERS:
        return ("leaf", t) if bad_leaf(t) else None
    stack = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if depth >= max_depth:
            return ("depth", None)
        if type(node) is dict:
            if len(node) > _SMALL_CONTAINER:
                if not set(map(type, node)) <= _KEY_TYPES:
                    return ("key", next(k for k in node if type(k) not in _KEY_TYPES))
            else:
                for k in node:
                    if type(k) is not str and type(k) is not int:
                        return ("key", k)
            values: Any = node.values()
        else:
            values = node
        if len(node) > _SMALL_CONTAINER:
            odd = set(map(type, values)) - _PLAIN_LEAVES
            if not odd:
                continue
            for vt in odd:
                if vt not in _CONTAINERS and bad_leaf(vt):
                    return ("leaf", vt)
            if odd & _CONTAINERS:
                stack.extend((v, depth + 1) for v in values if type(v) in _CONTAINERS)
        else:
            for v in values:
                vt = type(v)
                if vt in _PLAIN_LEAVES:
                    continue
                if vt in _CONTAINERS:
                    stack.append((v, depth + 1))
                elif bad_leaf(vt):
                    return ("leaf", vt)
    return None


def _unencodable_leaf(t: type) -> bool:
    """Leaf types the encoder rejects although msgpack would pack some natively (bytearray,
    memoryview, msgpack.Timestamp / ExtType) and every unknown type."""
    if t is np.ndarray or t is TensorData or issubclass(t, np.generic):
        return False
    torch = _torch()
    return torch is None or (t is not torch.Tensor and t is not torch.nn.Parameter)


def _check_encodable(obj: Any) -> None:
    """Raise the :class:`EncodeError` of :func:`_explain_unencodable` when ``obj`` has an
    unsupported leaf type, a dict key other than ``str``/``int`` or nesting deeper than
    ``_MAX_DEPTH`` (cycles included)."""
    if _first_fault(obj, _unencodable_leaf) is not None:
        _explain_unencodable(obj)


def _explain_unencodable(obj: Any) -> NoReturn:
    """The EncodeError naming the key path of a fault of ``obj`` (error path only).

    Descends from the root into the first child that :func:`_first_fault` rejects with the
    depth left to it, until the fault is at the node itself: O(elements x depth), paid only
    for a message that cannot be sent.
    """
    node, path = obj, ()
    while True:
        t = type(node)
        if t not in _CONTAINERS:
            raise EncodeError(f"{_path_str(path)}: cannot encode object of type {_type_name(t)}")
        if len(path) >= _MAX_DEPTH:
            raise EncodeError(f"{_path_str(path[:8])}...: containers nested more than {_MAX_DEPTH} deep (or a cycle)")
        if t is dict:
            bad = [k for k in node if type(k) not in _KEY_TYPES]
            if bad:
                raise EncodeError(
                    f"{_path_str(path)}: dict key {bad[0]!r} has type {_type_name(type(bad[0]))}; "
                    "only str and int keys are supported"
                )
        left = _MAX_DEPTH - len(path) - 1
        for k, v in _pairs(node):
            if _first_fault(v, _unencodable_leaf, left) is not None:
                node, path = v, path + (k,)
                break
        else:
            raise EncodeError("cannot encode message")  # unreachable when obj has a fault


class _EncodeState:
    """Per-call encoder state: the out-of-band frames and shared-memory slots collected so far."""

    __slots__ = ("config", "buffers", "oob_bytes", "shm", "slots")

    def __init__(self, config: CodecConfig, shm: ShmPool | None) -> None:
        self.config = config
        self.buffers: list[memoryview] = []
        self.oob_bytes = 0
        self.shm = shm
        self.slots: list = []  # (slot, generation) of the arrays copied into the pool

    def packb(self, obj: Any) -> bytes:
        return msgpack.Packer(default=self.default, strict_types=True, use_bin_type=True, buf_size=_PACK_BUF).pack(obj)

    def array_payload(self, name: str, shape: tuple[int, ...], flat_u8: np.ndarray) -> bytes:
        # flat_u8: 1-D C-contiguous uint8 view of the array's little-endian bytes.
        nbytes = flat_u8.nbytes
        if nbytes > self.config.max_message_bytes:
            raise EncodeError(
                f"array of {nbytes} bytes ({name} x {shape}) exceeds max_message_bytes={self.config.max_message_bytes}"
            )
        placed = None if self.shm is None or nbytes < self.config.inline_threshold else self.shm.put(flat_u8)
        if placed is not None:  # copied into a pool slot: the header carries its handle
            data: bytes | int | list = placed[0]
            self.slots.append(placed[1])
            self.oob_bytes += nbytes
        elif nbytes < self.config.inline_threshold:
            data = flat_u8.tobytes()
        else:
            # The memoryview keeps flat_u8 (and so the array or tensor behind it) alive for as
            # long as the frame exists; no copy is made.
            self.buffers.append(memoryview(flat_u8))
            self.oob_bytes += nbytes
            data = len(self.buffers)  # frame index: frame 0 is the header
        return msgpack.Packer(use_bin_type=True, buf_size=_PACK_BUF).pack([name, list(shape), data])

    def check_dtype(self, name: str, what: str) -> None:
        if name not in self.config.allowed_dtypes:
            raise EncodeError(f"{what} dtype {name!r} is not in the allow-list {sorted(self.config.allowed_dtypes)}")

    def default(self, obj: Any) -> msgpack.ExtType | list:
        t = type(obj)
        if t is tuple:
            return [_TUPLE_MARKER_EXT, *obj]
        if t is np.ndarray:
            return msgpack.ExtType(_EXT_NDARRAY, self.encode_ndarray(obj))
        if t is TensorData:
            self.check_dtype(obj.dtype, "torch tensor")
            return msgpack.ExtType(_EXT_TENSOR, self.array_payload(obj.dtype, obj.shape, obj.data))
        if issubclass(t, np.generic):
            name = _NUMPY_NAME.get(obj.dtype)  # numpy scalars are always native-order
            if name is None:
                raise EncodeError(f"numpy scalar of type {_type_name(t)} (dtype {obj.dtype}) is not supported")
            self.check_dtype(name, "numpy scalar")
            return msgpack.ExtType(_EXT_NUMPY_SCALAR, msgpack.packb([name, obj.tobytes()], use_bin_type=True))
        torch = _torch()
        if torch is not None and (t is torch.Tensor or t is torch.nn.Parameter):
            return msgpack.ExtType(_EXT_TENSOR, self.encode_tensor(obj))
        if t is int:
            # msgpack hands ints outside [-2**63, 2**64) to the default hook.
            raise EncodeError(f"int {obj} does not fit in 64 bits; send it as str or an array")
        raise EncodeError(f"cannot encode object of type {_type_name(t)}")

    def encode_ndarray(self, a: np.ndarray) -> bytes:
        name = _NUMPY_NAME.get(a.dtype)
        if name is None:  # big-endian, bfloat16 (ml_dtypes), or not supported at all
            dt = a.dtype
            if dt.kind not in "biuf" or dt.fields is not None or dt.name in _TORCH_ONLY_DTYPES:
                raise EncodeError(
                    f"numpy array dtype {dt} is not supported "
                    f"(allowed: {sorted(self.config.allowed_dtypes - _TORCH_ONLY_DTYPES)}; "
                    "bfloat16 only as a torch tensor)"
                )
            name = dt.name
            self.check_dtype(name, "numpy array")
            a = a.astype(dt.newbyteorder("="), order="C")  # the wire is little-endian
        else:
            self.check_dtype(name, "numpy array")
            if not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)  # 0-d arrays are always contiguous, so ndim is kept
        return self.array_payload(name, a.shape, a.reshape(-1).view(np.uint8))

    def encode_tensor(self, t: Any) -> bytes:
        torch = _torch()
        name = str(t.dtype).removeprefix("torch.")
        if t.layout is not torch.strided:
            raise EncodeError(f"torch tensor layout {t.layout} is not supported (dense tensors only)")
        if t.device.type != "cpu":
            # A device-to-host copy is a synchronisation point; make it explicit at the caller.
            raise EncodeError(f"torch tensor on device {t.device} is not supported; move it to CPU first")
        self.check_dtype(name, "torch tensor")
        t = t.detach()  # autograd state does not travel
        if not t.is_contiguous():
            t = t.contiguous()
        # .numpy() of the uint8 view shares the tensor's memory and keeps the tensor alive.
        flat = t.reshape(-1).view(torch.uint8).numpy()
        return self.array_payload(name, tuple(t.shape), flat)


class _DecodeState:
    """Per-call decoder state: the frames as byte memoryviews, which ones were referenced, and
    the work budget left (see :data:`DEFAULT_DECODE_BUDGET_FLOOR`)."""

    __slots__ = ("config", "views", "used", "budget", "torch_tensors", "shm", "bytes_left")

    def __init__(self, config: CodecConfig, views: list[memoryview], shm: ShmReader | None,
                 frame_bytes: int) -> None:
        self.config = config
        self.views = views
        self.shm = shm
        self.bytes_left = config.max_message_bytes - frame_bytes  # shared-memory arrays count too
        self.used: set[int] = set()
        self.budget = config.decode_budget_floor + config.decode_budget_per_byte * views[0].nbytes
        # Tensors become torch tensors only in a process that already imported torch; anywhere
        # else they stay TensorData, so a torch-free actor never pays torch's import.
        self.torch_tensors = _torch() is not None

    def unpackb(self, data: Any) -> Any:
        limit = min(self.config.max_container_len, len(data))
        return msgpack.unpackb(
            data, ext_hook=self.ext_hook, list_hook=self.list_hook, object_hook=self.object_hook,
            raw=False, strict_map_key=False, use_list=True, max_array_len=limit, max_map_len=limit,
        )

    def spend(self, units: int) -> None:
        self.budget -= units
        if self.budget < 0:
            header = self.views[0].nbytes
            raise MessageTooLarge(
                f"header of {header} bytes decodes to more objects than its budget of "
                f"{self.config.decode_budget_floor} + {self.config.decode_budget_per_byte} x {header} "
                f"units (a list costs {CONTAINER_UNITS} + 1 per element, a dict {DICT_UNITS} + "
                f"{DICT_ITEM_UNITS} per item); send bulk data as arrays"
            )

    def list_hook(self, items: list) -> list | tuple:
        self.spend(CONTAINER_UNITS + len(items))
        if items and items[0] is _TUPLE_MARKER:
            return tuple(items[1:])
        return items

    def object_hook(self, items: dict) -> dict:
        self.spend(DICT_UNITS + DICT_ITEM_UNITS * len(items))
        return items

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_TUPLE:
            if data:
                raise DecodeError(f"tuple marker (ext type {_EXT_TUPLE}) must be empty, has {len(data)} bytes")
            return _TUPLE_MARKER
        if code == _EXT_NDARRAY or code == _EXT_TENSOR:
            return self.decode_array(code, data)
        if code == _EXT_NUMPY_SCALAR:
            return self.decode_scalar(data)
        raise DecodeError(f"unknown ext type {code}")

    def check_dtype(self, name: Any, what: str) -> str:
        if type(name) is not str:
            raise DecodeError(f"{what} dtype name must be a str, got {type(name).__name__}")
        if name not in self.config.allowed_dtypes:
            raise DecodeError(
                f"{what} dtype {_clip(name)!r} is not in the allow-list {sorted(self.config.allowed_dtypes)}")
        if what != "torch tensor" and name in _TORCH_ONLY_DTYPES:
            raise DecodeError(f"{what} dtype {name!r} is only allowed for torch tensors")
        return name

    def decode_scalar(self, data: bytes) -> np.generic:
        self.spend(CONTAINER_UNITS)
        header = _unpack_ext_payload(data, 2)
        if type(header) is not list or len(header) != 2:
            raise DecodeError("numpy scalar ext payload must be [dtype name, bytes]")
        name, raw = header
        dt = np.dtype(self.check_dtype(name, "numpy scalar"))
        if type(raw) is not bytes or len(raw) != dt.itemsize:
            got = len(raw) if type(raw) is bytes else type(raw).__name__
            raise DecodeError(f"numpy scalar of dtype {name} needs {dt.itemsize} bytes, got {got}")
        return np.frombuffer(raw, dtype=dt)[0]

    def decode_array(self, code: int, data: bytes) -> Any:
        self.spend(CONTAINER_UNITS)
        what = "torch tensor" if code == _EXT_TENSOR else "numpy array"
        header = _unpack_ext_payload(data, _MAX_NDIM + 1)
        if type(header) is not list or len(header) != 3:
            raise DecodeError(f"{what} ext payload must be [dtype name, shape, data]")
        name, shape, payload = header
        self.check_dtype(name, what)
        if type(shape) is not list or len(shape) > _MAX_NDIM or any(type(d) is not int for d in shape):
            raise DecodeError(f"{what} shape must be a list of at most {_MAX_NDIM} ints, got {_clip(repr(shape))}")
        if any(d < 0 for d in shape):
            raise DecodeError(f"{what} shape {shape} has a negative dimension")
        itemsize = 2 if name == "bfloat16" else np.dtype(name).itemsize
        nbytes = math.prod(shape) * itemsize  # Python ints: no overflow on hostile shapes
        if nbytes > self.config.max_message_bytes:
            raise MessageTooLarge(
                f"{what} {name} x {tuple(shape)} needs {nbytes} bytes, "
                f"over max_message_bytes={self.config.max_message_bytes}"
            )
        _check_shape_as_numpy(what, name, shape, itemsize)  # zero-size arrays pass the line above
        if type(payload) is bytes:
            buf: Any = payload
            where = "inline data"
        elif type(payload) is int:
            if not 1 <= payload < len(self.views):
                raise DecodeError(
                    f"{what} refers to frame index {payload}, out of range for a message of {len(self.views)} frames"
                )
            if payload in self.used:
                raise DecodeError(f"frame {payload} is referenced by more than one array")
            self.used.add(payload)
            buf = self.views[payload]
            where = f"frame {payload}"
        elif type(payload) is list:
            return self.decode_shared(code, what, name, shape, nbytes, payload)
        else:
            raise DecodeError(f"{what} data must be inline bytes or a frame index (or a shared-memory "
                              f"handle), got {type(payload).__name__}")
        if len(buf) != nbytes:
            kind = "truncated" if len(buf) < nbytes else "too long"
            raise DecodeError(
                f"{what} {where} {kind}: has {len(buf)} bytes, dtype {name} x shape {tuple(shape)} needs {nbytes}"
            )
        if code == _EXT_NDARRAY:
            arr = np.frombuffer(buf, dtype=np.dtype(name)).reshape(shape)
            arr.flags.writeable = False
            return arr
        if not self.torch_tensors:
            return TensorData(name, tuple(shape), _readonly_bytes(buf, copy=type(payload) is bytes))
        return tensor_from_buffer(buf, name, shape, inline=type(payload) is bytes)


    def decode_shared(self, code: int, what: str, name: str, shape: list[int], nbytes: int,
                      handle: list) -> Any:
        """An array whose data is in a sender's pool slot (docs/design/transport.md#shm-transport): a view of the
        slot, which is released when the last view is dropped."""
        if self.shm is None:
            raise DecodeError(f"{what} data is a shared-memory handle, accepted only from an ipc "
                              "peer on this node")
        self.bytes_left -= nbytes
        if self.bytes_left < 0:
            raise MessageTooLarge(f"message with {what} {name} x {tuple(shape)} in shared memory "
                                  f"exceeds max_message_bytes={self.config.max_message_bytes}")
        if code == _EXT_NDARRAY:
            return self.shm.array(handle, np.dtype(name).str, tuple(shape), nbytes, writable=False)
        flat = self.shm.array(handle, "|u1", (nbytes,), nbytes, writable=self.torch_tensors)
        if not self.torch_tensors:
            return TensorData(name, tuple(shape), flat)
        return tensor_from_buffer(memoryview(flat), name, shape, inline=False)  # keeps the lease


_GC_PAUSE_BYTES = 64 << 10  # headers from this size decode with the cyclic GC paused

_MAX_ERROR_FIELD = 200  # characters of a hostile value quoted in an error message


def _clip(text: str) -> str:
    """``text`` cut to :data:`_MAX_ERROR_FIELD` characters, so an error quoting a hostile value
    (a 1 MB dtype name, a 64-entry shape) stays small."""
    return text if len(text) <= _MAX_ERROR_FIELD else f"{text[:_MAX_ERROR_FIELD]}... ({len(text)} chars)"


def _unpack_ext_payload(data: bytes, max_len: int) -> Any:
    """One array / scalar ext payload: a short msgpack list. Its containers are bounded by
    ``max_len`` elements and no maps, so a hostile payload cannot build a large structure."""
    try:
        return msgpack.unpackb(data, raw=False, use_list=True, max_array_len=max_len, max_map_len=0)
    except Exception as exc:
        raise DecodeError(f"malformed array ext payload: {type(exc).__name__}: {_clip(str(exc))}") from None


_MAX_INTP = np.iinfo(np.intp).max


def _check_shape_as_numpy(what: str, name: str, shape: list[int], itemsize: int) -> None:
    """Refuse a shape numpy refuses: each dimension and the product of the non-zero dimensions
    times the item size must fit in ``np.intp`` (numpy's "array is too big" check, which also
    applies to zero-size arrays such as ``(0, 2**62)``); torch alone would accept those."""
    size = itemsize
    for d in shape:
        if d > _MAX_INTP:
            raise DecodeError(f"{what} shape {shape}: dimension {d} does not fit in a 64-bit index")
        if d:
            size *= d
    if size > _MAX_INTP:
        raise DecodeError(
            f"{what} {name} x {tuple(shape)}: array is too big (the non-zero dimensions times "
            f"the item size exceed {_MAX_INTP}, as numpy refuses)"
        )


def _readonly_bytes(buf: Any, copy: bool) -> np.ndarray:
    """The bytes of a tensor as a read-only uint8 array (a copy of small inline data)."""
    arr = np.frombuffer(bytes(buf) if copy else buf, dtype=np.uint8)
    arr.flags.writeable = False
    return arr


_FOREIGN_LEAVES = frozenset({msgpack.Timestamp, _TupleMarker})
_is_foreign = _FOREIGN_LEAVES.__contains__  # bound once: the decoder's bad-leaf test


def _raise_foreign(t: type) -> NoReturn:
    if t is msgpack.Timestamp:
        raise DecodeError("unknown ext type -1 (msgpack timestamp)")
    raise DecodeError(f"tuple marker (ext type {_EXT_TUPLE}) outside the first slot of an array")


def _check_decoded(obj: Any) -> None:
    """Reject what msgpack produced without our ext hook (timestamps, ext -1), tuple markers out
    of place, dict keys that are not ``str``/``int`` and nesting deeper than ``_MAX_DEPTH`` (the
    encoder produces none of these); the walk is :func:`_first_fault`, as for encoding."""
    fault = _first_fault(obj, _is_foreign)
    if fault is None:
        return
    kind, detail = fault
    if kind == "depth":
        raise DecodeError(f"containers nested more than {_MAX_DEPTH} deep")
    if kind == "key":
        raise DecodeError(
            f"dict key {detail!r} has type {_type_name(type(detail))}; only str and int keys are allowed"
        )
    _raise_foreign(detail)


def _as_byte_view(frame: Any, index: int) -> memoryview:
    try:
        view = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
    except TypeError as exc:
        raise DecodeError(f"frame {index} is not a contiguous buffer: {exc}") from exc
    return view


class Codec:
    """Encoder/decoder of one message <-> list of frames (see the module docstring).

    Stateless between calls and safe to share across threads and sockets.

    Args:
        config: limits and dtype allow-list (:class:`CodecConfig`).
    """

    __slots__ = ("config",)

    def __init__(self, config: CodecConfig = CodecConfig()) -> None:
        if not isinstance(config, CodecConfig):
            raise TransportError(f"config must be a CodecConfig, got {type(config).__name__}")
        self.config = config

    def encode(self, obj: Any, shm: ShmPool | None = None) -> list[bytes | memoryview]:
        """Encode ``obj`` into ZeroMQ frames.

        Args:
            obj: ``None``, ``bool``, ``int`` (fits in 64 bits), ``float``, ``str``, ``bytes``,
                ``list``, ``tuple``, ``dict`` with ``str``/``int`` keys, numpy arrays and scalars
                and CPU torch tensors of an allowed dtype (any shape, 0-d, empty,
                non-contiguous), nested in any of the containers up to depth 256.
            shm: the sender's shared-memory pool, only for a peer on this node (``ipc://``):
                arrays of at least ``shm.min_array_bytes`` (and ``inline_threshold``) are copied
                into a pool slot now and the header carries the slot's handle; when the pool
                has no free slot they become frames as without it (docs/design/transport.md#shm-transport).

        Returns:
            ``[header, *buffers]``: frame 0 the msgpack header (``bytes``; a
            :class:`replayrl.transport.shm_pool.ShmHeader` holding the message's slots when it has any),
            frames 1.. one ``memoryview`` (uint8, C order) per other array of at least
            ``inline_threshold`` bytes, sharing the array's memory. Do not modify those arrays
            until the frames are sent.

        Raises:
            EncodeError: unsupported type (named, with its key path), dtype not in the
                allow-list, non-CPU or non-dense tensor, dict key not ``str``/``int``, int out of
                64-bit range, nesting deeper than 256 or a cycle, or a message larger than
                ``max_message_bytes``.
        """
        _check_encodable(obj)
        state = _EncodeState(self.config, shm)
        try:
            try:
                header = state.packb(obj)
            except EncodeError:
                raise
            except (TypeError, ValueError, OverflowError) as exc:
                raise EncodeError(f"cannot encode message: {exc}") from exc
            total = len(header) + state.oob_bytes
            if total > self.config.max_message_bytes:
                raise EncodeError(f"message of {total} bytes exceeds max_message_bytes={self.config.max_message_bytes}")
        except BaseException:
            ShmHeader(b"", state.slots)  # not sent: dropping it at once releases the slots
            raise
        if state.slots:
            header = ShmHeader(header, state.slots)
        return [header, *state.buffers]

    def decode(self, frames: Sequence[bytes | memoryview | zmq.Frame], shm: ShmReader | None = None) -> Any:
        """Decode the frames of one message.

        Args:
            frames: frame 0 the msgpack header, frames 1.. the out-of-band buffers; each a
                ``bytes``, ``memoryview`` (any C-contiguous buffer) or ``zmq.Frame``.
            shm: the process's shared-memory reader, given only for a message from an ipc peer
                on this node; without it a shared-memory handle is a :class:`DecodeError`.

        Returns:
            The message. Tuples come back as tuples, numpy scalars as numpy scalars. Arrays are
            built over the frames (or the sender's shared-memory slots) without copying: numpy
            arrays are read-only views, torch tensors share the frame's memory (see the module
            docstring).

        Raises:
            MessageTooLarge: all frames together, or one array, exceed ``max_message_bytes``.
            DecodeError: no frames, malformed msgpack in frame 0, unknown ext type, dtype outside
                the allow-list, bad or negative shape, inline data or frame shorter/longer than
                dtype x shape, frame index out of range or referenced twice, frames that no
                array references, dict keys other than ``str``/``int``, a shared-memory handle
                without ``shm`` or one that names no valid slot.
        """
        if len(frames) == 0:
            raise DecodeError("empty message: no frames")
        if len(frames) > self.config.max_frames:
            raise MessageTooLarge(f"message of {len(frames)} frames exceeds max_frames={self.config.max_frames}")
        views = [_as_byte_view(f, i) for i, f in enumerate(frames)]
        total = sum(v.nbytes for v in views)
        if total > self.config.max_message_bytes:
            raise MessageTooLarge(
                f"message of {total} bytes in {len(views)} frames "
                f"exceeds max_message_bytes={self.config.max_message_bytes}"
            )
        state = _DecodeState(self.config, views, shm, total)
        try:
            return _decode_with(state, views)
        except DecodeError:
            if shm is not None:  # refused: its slots go back to the sender now
                _release_handles(views[0], shm, self.config.max_container_len)
            raise


def _decode_with(state: _DecodeState, views: list[memoryview]) -> Any:
    """:meth:`Codec.decode` once the frames passed the size checks."""
    # The cyclic GC runs again and again while a large header allocates lists, doubling
    # the cost of a refused one; nothing decoded can be cyclic, so pause it (msgpack's own
    # advice for large messages). Global state, restored in every case.
    pause_gc = views[0].nbytes >= _GC_PAUSE_BYTES and gc.isenabled()
    if pause_gc:
        gc.disable()
    try:
        obj = state.unpackb(views[0])
    except DecodeError:
        raise
    except RecursionError as exc:
        raise DecodeError("malformed header: nesting too deep") from exc
    except Exception as exc:  # msgpack raises ValueError subclasses, TypeError, UnicodeDecodeError...
        raise DecodeError(f"malformed msgpack header (frame 0): {type(exc).__name__}: {_clip(str(exc))}") from exc
    finally:
        if pause_gc:
            gc.enable()
    if len(state.used) != len(views) - 1:
        unused = sorted(set(range(1, len(views))) - state.used)
        shown = f"{unused[:8]}" if len(unused) <= 8 else f"{str(unused[:8])[:-1]}, ...] ({len(unused)} in all)"
        raise DecodeError(f"message has {len(views)} frames but frames {shown} are referenced by no array")
    _check_decoded(obj)
    return obj


def _release_handles(header: memoryview, shm: ShmReader, max_len: int) -> None:
    """Release every shared-memory slot a refused message's header names, as far as its msgpack
    can be read (a slot it names after a corrupt byte stays with its sender's other rules,
    docs/design/transport.md#shm-transport). Arrays the refused decode built are gone by now
    and released themselves; :meth:`ShmReader.release` leaves any slot still viewed alone."""
    handles: list = []

    def collect(code: int, data: bytes) -> None:
        if code == _EXT_NDARRAY or code == _EXT_TENSOR:
            try:
                payload = msgpack.unpackb(data, raw=False, use_list=True, max_array_len=_MAX_NDIM + 1,
                                          max_map_len=0)
            except Exception:
                return None
            if type(payload) is list and len(payload) == 3 and type(payload[2]) is list:
                handles.append(payload[2])
        return None

    limit = min(max_len, len(header))
    try:
        msgpack.unpackb(header, ext_hook=collect, raw=False, strict_map_key=False, use_list=True,
                        max_array_len=limit, max_map_len=limit, max_str_len=len(header),
                        max_bin_len=len(header))
    except Exception:  # noqa: S110 - a malformed header: the handles before the fault were seen
        pass
    for handle in handles:
        shm.release(handle)


_DEFAULT_CODEC = Codec()


def encode(obj: Any) -> list[bytes | memoryview]:
    """Encode ``obj`` with a default :class:`Codec` (16 KiB inline threshold, 2 GiB limit, all
    dtypes allowed); see :meth:`Codec.encode` for types, return value and errors."""
    return _DEFAULT_CODEC.encode(obj)


def decode(frames: Sequence[bytes | memoryview | zmq.Frame]) -> Any:
    """Decode one message with a default :class:`Codec`; see :meth:`Codec.decode`."""
    return _DEFAULT_CODEC.decode(frames)
