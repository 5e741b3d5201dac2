"""replayrl.transport.codec under hostile input: what a frame may cost the decoder, numpy's shape rule,
torch-free tensor decoding, and a bounded fuzz of the codec (hypothesis)."""
from __future__ import annotations

import subprocess
import sys
import tracemalloc

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replayrl.transport import Codec, CodecConfig, DecodeError, MessageTooLarge, TransportError, decode, encode
from replayrl.transport.tensor_data import TensorData
from tests.paths import REPO

EXT_NDARRAY, EXT_TENSOR = 1, 2


def _array_of(body: bytes, n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + body * n  # msgpack array32 of n copies of body


def _peak_ratio(frame: bytes) -> tuple[str, float]:
    """(outcome, peak Python memory of decoding / frame bytes), measured with tracemalloc."""
    tracemalloc.start()
    try:
        decode([frame])
        outcome = "accepted"
    except DecodeError as exc:
        outcome = type(exc).__name__
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return outcome, peak / len(frame)


@pytest.mark.parametrize("body", [b"\x90", b"\x80", b"\x91\x90", b"\x81\x00\x90"],
                         ids=["empty-lists", "empty-maps", "nested-lists", "maps-of-lists"])
def test_one_mebibyte_of_empty_containers_is_refused_within_a_small_multiple(body):
    frame = _array_of(body, (1 << 20) // len(body))
    outcome, ratio = _peak_ratio(frame)
    assert outcome == "MessageTooLarge"
    # before the budget: ~75 bytes per wire byte; the budget stops at 16 x wire + the list slots
    assert ratio < 32, ratio


def test_the_budget_admits_ordinary_messages():
    rows = [{"sample": i, "reward": 0.5 * i, "tokens": np.arange(40, dtype=np.int32), "tag": f"s{i}"}
            for i in range(2000)]
    assert len(decode(encode(rows))) == 2000
    floats = [float(i) for i in range(200_000)]  # 9 bytes per element on the wire
    assert decode(encode(floats)) == floats


def test_budget_and_limits_are_configurable_and_checked():
    frame = msgpack.packb([[]] * 100)
    with pytest.raises(MessageTooLarge, match="budget"):
        Codec(CodecConfig(decode_budget_floor=0, decode_budget_per_byte=1)).decode([frame])
    assert Codec(CodecConfig(decode_budget_floor=1000)).decode([frame]) == [[]] * 100
    with pytest.raises(DecodeError):
        Codec(CodecConfig(max_container_len=10)).decode([msgpack.packb(list(range(11)))])
    with pytest.raises(MessageTooLarge, match="max_frames=4"):
        Codec(CodecConfig(max_frames=4)).decode([b"\xc0"] + [b""] * 4)
    for bad in ({"max_frames": 0}, {"max_container_len": -1}, {"decode_budget_floor": -1}):
        with pytest.raises(TransportError):
            CodecConfig(**bad)


def test_error_text_quoting_hostile_values_stays_short():
    frames = [msgpack.packb(None)] + [b""] * 60_000
    with pytest.raises(DecodeError) as info:
        decode(frames)
    assert len(str(info.value)) < 300 and "60000 in all" in str(info.value)
    huge_name = msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["x" * 1_000_000, [1], b"\x00"]))
    with pytest.raises(DecodeError) as info:
        decode([msgpack.packb(huge_name)])
    assert len(str(info.value)) < 1000


SHAPES = [(0, 2**53), (0, 2**62), (0, 2**61, 2**61), (2**63,), (0, 2**63 - 1), (0, 2**31, 2**31, 4),
          (0, 0, 2**62), (3, 0, 2**60), (0,), (0, 5)]


@pytest.mark.parametrize("code", [EXT_NDARRAY, EXT_TENSOR], ids=["numpy", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_zero_size_shapes_are_judged_as_numpy_judges_them(code, shape):
    try:  # the reference: numpy's own reshape of an empty float32 buffer
        np.frombuffer(b"", np.float32).reshape(shape)
        numpy_accepts = True
    except (ValueError, OverflowError):
        numpy_accepts = False
    frame = msgpack.packb(msgpack.ExtType(code, msgpack.packb(["float32", list(shape), b""])))
    if numpy_accepts:
        out = decode([frame])
        assert tuple(out.shape) == shape
    else:
        with pytest.raises(DecodeError, match="too big|64-bit|max_message_bytes"):
            decode([frame])


def test_tensors_decode_without_torch_and_travel_on_unchanged():
    x = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    y = torch.linspace(0, 1, 5000, dtype=torch.float32)  # out of band
    frames = encode({"x": x, "y": y})
    script = (
        "import sys, json\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from transport import decode, encode\n"
        "frames = [bytes.fromhex(h) for h in json.load(sys.stdin)]\n"
        "msg = decode(frames)\n"
        "assert 'torch' not in sys.modules, 'decoding imported torch'\n"
        "y = msg['y'].numpy()\n"
        "out = {'kinds': [type(msg['x']).__name__, msg['x'].dtype, list(msg['x'].shape)],\n"
        "       'y_sum': float(y.astype('float64').sum()),\n"
        "       'again': [bytes(f).hex() for f in encode(msg)], 'torch': 'torch' in sys.modules}\n"
        "print(json.dumps(out))\n")
    import json

    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps([bytes(f).hex() for f in frames]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["kinds"] == ["TensorData", "bfloat16", [3, 4]] and out["torch"] is False
    assert out["y_sum"] == pytest.approx(float(y.double().sum()), rel=1e-6)
    again = decode([bytes.fromhex(h) for h in out["again"]])  # re-encoded by the torch-free side
    assert torch.equal(again["x"], x) and torch.equal(again["y"], y)


def test_tensor_data_views():
    t = TensorData("int16", (2, 2), np.arange(8, dtype=np.uint8))
    assert np.array_equal(t.numpy(), np.arange(8, dtype=np.uint8).view(np.int16).reshape(2, 2))
    assert torch.equal(t.torch(), torch.from_numpy(t.numpy().copy()))
    with pytest.raises(TypeError, match="bfloat16"):
        TensorData("bfloat16", (1,), np.zeros(2, np.uint8)).numpy()


# --- fuzz ---------------------------------------------------------------------------------

_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=20), st.binary(max_size=20))
_values = st.recursive(_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.tuples(inner, inner),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers(-5, 5)), inner, max_size=5)), max_leaves=30)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@FUZZ
@given(_values)
def test_fuzz_round_trip_of_plain_values(value):
    assert decode(encode(value)) == value


@FUZZ
@given(st.binary(max_size=2000), st.lists(st.binary(max_size=64), max_size=4))
def test_fuzz_arbitrary_frames_decode_or_raise_decode_error(header, extra):
    try:
        decode([header, *extra])
    except DecodeError:
        pass


@FUZZ
@given(_values, st.integers(0, 10_000), st.binary(min_size=1, max_size=8))
def test_fuzz_mutated_valid_headers_decode_or_raise_decode_error(value, at, patch):
    header = bytearray(encode({"v": value, "a": np.arange(3, dtype=np.int16)})[0])
    at %= len(header)
    header[at:at + len(patch)] = patch
    try:
        decode([bytes(header)])
    except DecodeError:
        pass


# --- fuzz against a live actor ------------------------------------------------------------

@pytest.fixture(scope="module")
def live_actor(tmp_path_factory):
    """An EchoActor served in its own process on an ipc socket; yields its endpoint."""
    import tempfile

    run_dir = tempfile.mkdtemp(prefix="rrl-fz-")
    endpoint = f"ipc://{run_dir}/a"
    script = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from actors import Directory, run_event_loop, serve_actor\n"
        "from tests.actor_fixtures import EchoActor\n"
        f"run_event_loop(serve_actor(EchoActor(), 'a', Directory({{'a': {endpoint!r}}}), os.getppid()))\n")
    proc = subprocess.Popen([sys.executable, "-c", script])
    yield endpoint
    proc.kill()
    proc.wait(30)
    import shutil
    shutil.rmtree(run_dir, ignore_errors=True)


def _ping_through(sock, call_id: int) -> dict:
    """Send a valid call after whatever came before; return its reply, skipping error replies
    to the fuzzed messages (hang guard: 60 s)."""
    sock.send_multipart(encode({"k": "call", "id": call_id, "m": "echo", "a": [call_id], "kw": {}}))
    while sock.poll(60_000):
        reply = decode(sock.recv_multipart())
        if reply["id"] == call_id:
            return reply
    raise AssertionError("the actor stopped answering")  # pragma: no cover


_envelopes = st.fixed_dictionaries({"k": st.sampled_from(["call", "tell", "ok", "x"]), "id": st.integers(-5, 2**40),
                                    "m": st.sampled_from(["echo", "on_start", "__stop__x", "ref", "", "total"]),
                                    "a": st.lists(_values, max_size=3),
                                    "kw": st.dictionaries(st.text(max_size=3), _values, max_size=2)})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(envelope=_envelopes, noise=st.binary(max_size=300), at=st.integers(0, 1000),
       extra=st.lists(st.binary(max_size=32), max_size=3))
def test_fuzz_live_actor_survives_and_answers(live_actor, envelope, noise, at, extra):
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(live_actor)
    try:
        header = bytearray(encode(envelope)[0])
        header[at % len(header):at % len(header) + len(noise)] = noise
        if envelope["m"] != "__stop__x":  # never fuzz the stop builtin into a valid stop
            sock.send_multipart([bytes(header), *extra])
        sock.send_multipart([noise or b"\xc1", *extra])
        call_id = 2**50 + at
        reply = _ping_through(sock, call_id)
        assert reply == {"k": "ok", "id": call_id, "v": call_id}
    finally:
        sock.close(0)


def test_bench_decode_measures_refusal_and_plain_decoding():
    from replayrl.tools.bench.decode import frame_of, measure

    frame = frame_of(b"\x90", 1 << 18)
    assert len(frame) == 5 + (1 << 18) and msgpack.unpackb(frame) == [[]] * (1 << 18)
    outcome, seconds, ratio = measure(lambda f: decode([f]), frame)
    assert outcome == "refused (MessageTooLarge)" and seconds > 0 and ratio > 1
    assert measure(msgpack.unpackb, frame)[0] == "decoded"
