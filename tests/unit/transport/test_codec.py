"""replayrl.transport.codec: round trips compared bit for bit with the input, zero copy above the inline
threshold, and typed rejection of malformed messages. Malformed messages are built here with
msgpack directly, following the wire format in the codec's docstring, not with the encoder."""

from __future__ import annotations

import dataclasses
import gc
import pickle
from collections import OrderedDict

import msgpack
import numpy as np
import pytest
import torch
import zmq

from replayrl.transport import (
    DEFAULT_INLINE_THRESHOLD,
    Codec,
    CodecConfig,
    DecodeError,
    EncodeError,
    MessageTooLarge,
    TransportError,
    decode,
    encode,
)

NUMPY_DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
]  # fmt: skip
TORCH_DTYPES = NUMPY_DTYPES + ["bfloat16"]

# Same-width integer type used to compare floats bit for bit (NaN payloads, -0.0 included).
_TORCH_BITS = {
    "float16": torch.int16,
    "bfloat16": torch.int16,
    "float32": torch.int32,
    "float64": torch.int64,
}

EXT_NDARRAY, EXT_TENSOR, EXT_NUMPY_SCALAR, EXT_TUPLE = 1, 2, 3, 4
TUPLE_MARK = msgpack.ExtType(EXT_TUPLE, b"")  # first element of an array that is a tuple


def _numpy_values(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random values over the dtype's range; floats include nan, +-inf, -0.0 and a subnormal."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == "bool":
        flat = rng.integers(0, 2, n).astype(bool)
    elif dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        flat = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    else:
        flat = (rng.standard_normal(n) * 100).astype(dtype)
        specials = np.array([np.nan, np.inf, -np.inf, -0.0, np.finfo(dtype).smallest_subnormal], dtype=dtype)
        flat[: min(n, 5)] = specials[: min(n, 5)]
    return flat.reshape(shape)


def _torch_values(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(_numpy_values("float32", shape, seed)).to(torch.bfloat16)
    return torch.from_numpy(_numpy_values(dtype, shape, seed))


def _assert_numpy_identical(got: object, want: np.ndarray) -> None:
    assert type(got) is np.ndarray
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()  # C-order bytes of the input, bit for bit


def _assert_torch_identical(got: object, want: torch.Tensor, dtype: str) -> None:
    assert type(got) is torch.Tensor
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype in _TORCH_BITS:
        assert torch.equal(got.view(_TORCH_BITS[dtype]), want.contiguous().view(_TORCH_BITS[dtype]))
    else:
        assert torch.equal(got, want)


# name -> (base shape, view taken of it); the big ones exceed the inline threshold for every dtype
SHAPE_CASES = {
    "0d": ((), lambda a: a),
    "empty_0x3": ((0, 3), lambda a: a),
    "1d": ((7,), lambda a: a),
    "3d": ((2, 3, 4), lambda a: a),
    "big_2d": ((64, 300), lambda a: a),
    "strided_cols": ((64, 300), lambda a: a[:, ::2]),
    "transposed": ((64, 300), lambda a: a.T),
    "strided_3d": ((4, 6, 8), lambda a: a[1:, ::2, ::-3]),
}


@pytest.mark.parametrize("case", list(SHAPE_CASES))
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_round_trip_is_bitwise(dtype: str, case: str) -> None:
    shape, view = SHAPE_CASES[case]
    arr = view(_numpy_values(dtype, shape))
    out = decode(encode(arr))
    _assert_numpy_identical(out, arr)
    assert not out.flags.writeable


@pytest.mark.parametrize("case", [c for c in SHAPE_CASES if c != "strided_3d"])
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_round_trip_is_bitwise(dtype: str, case: str) -> None:
    shape, view = SHAPE_CASES[case]
    t = _torch_values(dtype, shape)
    t = t.T if case == "transposed" else view(t)
    assert case not in ("strided_cols", "transposed") or not t.is_contiguous()
    _assert_torch_identical(decode(encode(t)), t, dtype)


def test_torch_negative_stride_and_grad_round_trip() -> None:
    base = torch.linspace(-3, 3, 48, dtype=torch.float32).reshape(4, 12)
    flipped = base.flip(0)[:, 1::3]  # a flip is a copy in torch; slice for a real stride
    _assert_torch_identical(decode(encode(flipped)), flipped, "float32")
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    out = decode(encode(p))
    assert type(out) is torch.Tensor and not out.requires_grad
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_bfloat16_travels_as_raw_two_byte_words() -> None:
    t = _torch_values("bfloat16", (128, 128))  # 32 KiB: out of band
    frames = encode(t)
    assert len(frames) == 2
    words = np.frombuffer(frames[1], dtype=np.int16)
    assert words.shape == (128 * 128,)
    assert np.array_equal(words, t.view(torch.int16).reshape(-1).numpy())
    assert np.shares_memory(words, t.view(torch.int16).numpy())  # no copy on the sending side


def test_big_endian_numpy_arrives_native_with_same_values() -> None:
    arr = np.arange(-3, 4995, dtype=">i4").reshape(-1, 7)[:, 1:]  # 17 KB: out of band
    out = decode(encode(arr))
    assert out.dtype == np.dtype("int32") and out.dtype.isnative
    assert out.tolist() == arr.tolist()


def test_nested_containers_keep_types_and_values() -> None:
    a = _numpy_values("float32", (40, 200), seed=1)  # out of band
    b = _numpy_values("int64", (3,), seed=2)  # inline
    t = _torch_values("bfloat16", (5, 9), seed=3)[:, ::2]
    msg = {
        "method": "generate",
        7: [None, True, False, -(2**63), 2**64 - 1, 1.5, "ünïcode", b"\x00\xff", [], {}, ()],
        "arrays": (a, [b, {"t": t}], (a[::3],)),
        "nested": {"deep": [(1, (2, [3, (4,)]))]},
    }
    out = decode(encode(msg))
    assert set(out) == {"method", 7, "arrays", "nested"}
    assert out["method"] == "generate"
    assert out[7] == [None, True, False, -(2**63), 2**64 - 1, 1.5, "ünïcode", b"\x00\xff", [], {}, ()]
    assert [type(v) for v in out[7]] == [type(None), bool, bool, int, int, float, str, bytes, list, dict, tuple]
    arrays = out["arrays"]
    assert type(arrays) is tuple and type(arrays[1]) is list and type(arrays[2]) is tuple
    _assert_numpy_identical(arrays[0], a)
    _assert_numpy_identical(arrays[1][0], b)
    _assert_torch_identical(arrays[1][1]["t"], t, "bfloat16")
    _assert_numpy_identical(arrays[2][0], a[::3])
    assert out["nested"] == {"deep": [(1, (2, [3, (4,)]))]}
    assert type(out["nested"]["deep"][0][1][1]) is list


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_scalars_round_trip_with_their_type(dtype: str) -> None:
    value = _numpy_values(dtype, (3,), seed=4)[2]
    out = decode(encode({"v": value}))["v"]
    assert type(out) is type(value)
    assert out.tobytes() == value.tobytes()


def test_pickled_bytes_stay_plain_bytes() -> None:
    payload = pickle.dumps({"x": np.arange(3)})
    assert decode(encode(payload)) == payload
    assert type(decode(encode([payload]))[0]) is bytes


def test_above_threshold_is_own_frame_and_decoded_without_copy() -> None:
    arr = _numpy_values("float32", (DEFAULT_INLINE_THRESHOLD // 4,), seed=5)  # exactly the threshold
    frames = encode({"x": arr})
    assert len(frames) == 2
    # The encoder hands out the array's own memory.
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), arr)
    # On the receiving side the array is built over the received frame, not a copy of it.
    received = zmq.Frame(bytes(frames[1]))
    out = decode([frames[0], received])["x"]
    frame_address = np.frombuffer(received.buffer, dtype=np.uint8).__array_interface__["data"][0]
    assert out.__array_interface__["data"][0] == frame_address
    assert np.shares_memory(out, np.frombuffer(received.buffer, dtype=np.uint8))
    _assert_numpy_identical(out, arr)


def test_torch_above_threshold_shares_the_received_frame() -> None:
    t = _torch_values("bfloat16", (64, 256), seed=6)
    frames = encode(t)
    assert len(frames) == 2
    received = bytearray(frames[1])
    out = decode([frames[0], received])
    assert out.data_ptr() == np.frombuffer(received, dtype=np.uint8).__array_interface__["data"][0]
    _assert_torch_identical(out, t, "bfloat16")


def test_decoded_arrays_keep_their_frames_alive() -> None:
    arr = _numpy_values("int32", (50_000,), seed=7)
    t = _torch_values("float32", (50_000,), seed=8)
    frames = encode([arr, t])
    wire = [frames[0]] + [zmq.Frame(bytes(f)) for f in frames[1:]]
    out = decode(wire)
    del wire, frames
    gc.collect()
    _assert_numpy_identical(out[0], arr)
    _assert_torch_identical(out[1], t, "float32")


def test_below_threshold_is_inline() -> None:
    arr = np.arange(DEFAULT_INLINE_THRESHOLD - 1, dtype=np.uint8)
    frames = encode([arr, torch.from_numpy(arr.copy())])
    assert len(frames) == 1
    out = decode(frames)
    _assert_numpy_identical(out[0], arr)
    assert out[1].tolist() == arr.tolist()


def test_inline_threshold_is_configurable() -> None:
    arr = np.arange(10, dtype=np.int16)
    assert len(Codec(CodecConfig(inline_threshold=0)).encode(arr)) == 2
    big = np.zeros(100_000, dtype=np.uint8)
    assert len(Codec(CodecConfig(inline_threshold=1 << 20)).encode(big)) == 1


def test_inline_torch_tensor_is_writable_and_not_aliasing_bytes() -> None:
    out = decode(encode(torch.tensor(5, dtype=torch.int8)))
    out += 1  # would corrupt a shared bytes object if it aliased msgpack's buffer
    assert out.item() == 6
    assert decode(encode(torch.tensor(5, dtype=torch.int8))).item() == 5


def test_accepts_bytes_memoryview_and_zmq_frames() -> None:
    arr = _numpy_values("uint16", (30_000,), seed=9)
    header, body = encode({"a": arr})
    for wire in ([header, bytes(body)], [memoryview(header), body], [zmq.Frame(header), zmq.Frame(bytes(body))]):
        _assert_numpy_identical(decode(wire)["a"], arr)
    t = _torch_values("int16", (30_000,), seed=10)
    header, body = encode(t)
    for frame in (bytes(body), bytearray(body), zmq.Frame(bytes(body))):
        _assert_torch_identical(decode([header, frame]), t, "int16")


# --- rejections on decode -------------------------------------------------------------------


def _ext(code: int, payload: object) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(payload, use_bin_type=True))


def _header(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty message"),
        ([b"\xc1"], "malformed msgpack"),
        ([_header({"a": [1, 2, 3]})[:-1]], "malformed msgpack"),
        ([b"\xa2\xff\xfe"], "malformed msgpack"),  # str with invalid UTF-8
        ([_header(1) + b"\x01"], "malformed msgpack"),  # trailing garbage
        ([_header(msgpack.ExtType(42, b""))], "unknown ext type 42"),
        ([_header({"t": msgpack.Timestamp(1, 0)})], "unknown ext type -1"),
        ([_header(msgpack.Timestamp(1, 0))], "unknown ext type -1"),
        ([_header(_ext(EXT_NDARRAY, ["float32", [4], b"\x00" * 15]))], "truncated"),
        ([_header(_ext(EXT_NDARRAY, ["float32", [4], b"\x00" * 17]))], "too long"),
        ([_header(_ext(EXT_TENSOR, ["bfloat16", [2, 3], b"\x00" * 11]))], "truncated"),
        ([_header(_ext(EXT_NDARRAY, ["int64", [2, 3], 1])), b"\x00" * 47], "truncated"),
        ([_header(_ext(EXT_NDARRAY, ["int64", [2, 3], 1])), b"\x00" * 49], "too long"),
        ([_header(_ext(EXT_NDARRAY, ["uint8", [4], 2])), b"\x00" * 4], "out of range"),
        ([_header(_ext(EXT_NDARRAY, ["uint8", [4], 0])), b"\x00" * 4], "out of range"),
        ([_header(_ext(EXT_NDARRAY, ["uint8", [4], -1])), b"\x00" * 4], "out of range"),
        ([_header(_ext(EXT_NDARRAY, ["uint8", [4], 1])), b"\x00" * 4, b"\x00" * 4], r"frames \[2\]"),
        ([_header({"x": 1}), b"stray"], r"frames \[1\]"),
        ([_header([_ext(EXT_NDARRAY, ["uint8", [4], 1])] * 2), b"\x00" * 4], "more than one array"),
        ([_header(_ext(EXT_NDARRAY, ["complex64", [1], b"\x00" * 8]))], "allow-list"),
        ([_header(_ext(EXT_NDARRAY, ["object", [1], b"\x00" * 8]))], "allow-list"),
        ([_header(_ext(EXT_NDARRAY, ["bfloat16", [1], b"\x00" * 2]))], "only allowed for torch"),
        ([_header(_ext(EXT_TENSOR, [b"float32", [1], b"\x00" * 4]))], "dtype name must be a str"),
        ([_header(_ext(EXT_NDARRAY, ["float32", [2, -1], b""]))], "negative dimension"),
        ([_header(_ext(EXT_NDARRAY, ["float32", [2.0], b"\x00" * 8]))], "shape must be a list"),
        ([_header(_ext(EXT_NDARRAY, ["float32", [True], b"\x00" * 4]))], "shape must be a list"),
        ([_header(_ext(EXT_NDARRAY, ["float32", [1] * 65, b"\x00" * 4]))], "shape must be a list"),
        ([_header(_ext(EXT_NDARRAY, ["float32", [1], 1.0]))], "inline bytes or a frame index"),
        ([_header(_ext(EXT_NDARRAY, ["float32", [1]]))], r"\[dtype name, shape, data\]"),
        ([_header(_ext(EXT_NUMPY_SCALAR, ["float64", b"\x00" * 4]))], "needs 8 bytes"),
        ([_header([1, TUPLE_MARK])], "outside the first slot"),
        ([_header({"t": TUPLE_MARK})], "outside the first slot"),
        ([_header(TUPLE_MARK)], "outside the first slot"),
        ([_header([msgpack.ExtType(EXT_TUPLE, b"x"), 1])], "must be empty"),
        ([_header({b"bytes-key": 1})], "only str and int keys"),
        ([_header({1.5: 1})], "only str and int keys"),
        ([_header({True: 1})], "only str and int keys"),
    ],
)
def test_malformed_messages_raise_decode_error(frames: list, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode(frames)


def test_pickle_stream_is_rejected_and_never_executed() -> None:
    calls = []

    class Evil:
        def __reduce__(self):
            return (calls.append, ("unpickled",))

    with pytest.raises(DecodeError):
        decode([pickle.dumps(Evil())])
    assert calls == []


@pytest.mark.parametrize(("depth", "match"), [(400, "more than 256 deep"), (5000, "malformed msgpack")])
def test_deeply_nested_tuples_raise_decode_error(depth: int, match: str) -> None:
    # Built as raw bytes: msgpack's packer would itself refuse this depth.
    header = b"\x92\xc7\x00\x04" * depth + b"\xc0"  # (marker, (marker, ... None))
    with pytest.raises(DecodeError, match=match):
        decode([header])


def test_total_size_over_limit_raises_message_too_large() -> None:
    codec = Codec(CodecConfig(max_message_bytes=1000))
    frames = [_header(_ext(EXT_NDARRAY, ["uint8", [990], 1])), b"\x00" * 990]
    with pytest.raises(MessageTooLarge, match="exceeds max_message_bytes=1000"):
        codec.decode(frames)
    assert issubclass(MessageTooLarge, DecodeError)


def test_array_claiming_huge_shape_raises_message_too_large() -> None:
    frames = [_header(_ext(EXT_NDARRAY, ["float64", [1 << 40, 1 << 40], 1])), b"\x00" * 8]
    with pytest.raises(MessageTooLarge, match="over max_message_bytes"):
        decode(frames)


def test_restricted_allow_list_rejects_both_ways() -> None:
    codec = Codec(CodecConfig(allowed_dtypes=frozenset({"int32"})))
    with pytest.raises(EncodeError, match="'float64' is not in the allow-list"):
        codec.encode(np.zeros(2))
    with pytest.raises(DecodeError, match="'float64' is not in the allow-list"):
        codec.decode([_header(_ext(EXT_NDARRAY, ["float64", [1], b"\x00" * 8]))])
    out = codec.decode([_header(_ext(EXT_NDARRAY, ["int32", [2], b"\x01\x00\x00\x00\xff\xff\xff\xff"]))])
    assert out.tolist() == [1, -1]


def test_hand_built_message_decodes_to_expected_values() -> None:
    """The wire format written by hand (docstring of replayrl.transport.codec) decodes as documented."""
    words = np.array([0x3F80, 0xC000], dtype="<u2").tobytes()  # bf16 1.0, -2.0
    body = np.arange(6, dtype="<i4").tobytes()
    frames = [
        _header(
            {
                "a": _ext(EXT_NDARRAY, ["int32", [2, 3], 1]),
                "b": _ext(EXT_TENSOR, ["bfloat16", [2], words]),
                "c": _ext(EXT_NUMPY_SCALAR, ["uint16", b"\x01\x02"]),
                "d": [TUPLE_MARK, 1, "x"],
                "e": [TUPLE_MARK],
            }
        ),
        body,
    ]
    out = decode(frames)
    assert out["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and out["a"].dtype == np.int32
    assert out["b"].dtype == torch.bfloat16 and out["b"].tolist() == [1.0, -2.0]
    assert type(out["c"]) is np.uint16 and int(out["c"]) == 0x0201
    assert out["d"] == (1, "x") and out["e"] == ()


# --- rejections on encode -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Frozen:
    x: int = 1


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        (_Frozen(), "_Frozen"),
        ({"sample": [1, {"field": _Frozen()}]}, r"message\['sample'\]\[1\]\['field'\].*_Frozen"),
        ({1, 2}, "type set"),
        (object(), "type object"),
        (bytearray(b"x"), "bytearray"),
        (memoryview(b"x"), "memoryview"),
        (OrderedDict(a=1), "OrderedDict"),
        (msgpack.Timestamp(1, 0), "Timestamp"),
        ({1.5: "x"}, "dict key 1.5"),
        ({True: "x"}, "dict key True"),
        ({(1, 2): "x"}, "dict key"),
        (2**64, "64 bits"),
        (-(2**63) - 1, "64 bits"),
        (np.array(["a"]), "dtype <U1"),
        (np.array([1 + 2j]), "complex128"),
        (np.array([None], dtype=object), "object"),
        (np.zeros(2, dtype=[("a", "f4")]), "not supported"),
        (np.ma.masked_array([1, 2]), "MaskedArray"),
        (np.complex64(1), "complex64"),
        (np.str_("x"), "not supported"),
        (torch.zeros(2, dtype=torch.complex64), "complex64"),
        (torch.zeros(2).to_sparse(), "layout"),
        (torch.zeros(2, device="meta"), "device meta"),
    ],
)
def test_unsupported_values_raise_encode_error(obj: object, match: str) -> None:
    with pytest.raises(EncodeError, match=match):
        encode(obj)


def test_cycles_and_deep_nesting_raise_encode_error() -> None:
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(EncodeError, match="more than 256 deep"):
        encode(cyclic)
    deep: object = 0
    for _ in range(256):
        deep = (deep,)
    out = decode(encode(deep))  # 256 nested containers: the limit, accepted both ways
    for _ in range(256):
        assert type(out) is tuple and len(out) == 1
        out = out[0]
    assert out == 0
    with pytest.raises(EncodeError, match="more than 256 deep"):
        encode([deep])


def test_encode_over_limit_raises_encode_error() -> None:
    codec = Codec(CodecConfig(max_message_bytes=4096))
    with pytest.raises(EncodeError, match="exceeds max_message_bytes"):
        codec.encode(np.zeros(8192, dtype=np.uint8))
    with pytest.raises(EncodeError, match="exceeds max_message_bytes"):
        codec.encode(b"x" * 5000)


def test_bad_config_raises_transport_error() -> None:
    with pytest.raises(TransportError, match="inline_threshold"):
        CodecConfig(inline_threshold=-1)
    with pytest.raises(TransportError, match="max_message_bytes"):
        CodecConfig(max_message_bytes=0)
    with pytest.raises(TransportError, match="complex64"):
        CodecConfig(allowed_dtypes=frozenset({"complex64"}))
