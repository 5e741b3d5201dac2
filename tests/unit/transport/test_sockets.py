"""replayrl.transport.sockets: RouterSocket/DealerSocket echo over ipc:// and tcp:// loopback with many
messages in flight, large out-of-band arrays, endpoint checks and error paths.

Waits use asyncio.wait_for only as a hang guard (generous limit); nothing asserts on timing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from replayrl.transport import (
    DealerSocket,
    RouterSocket,
    TransportError,
    decode,
    encode,
    ipc_endpoint,
    tcp_loopback_endpoint,
)
from replayrl.transport.curve import CurveKeys
from replayrl.transport.errors import PeerUnreachable

HANG_GUARD_S = 60
N_IN_FLIGHT = 300
BIG_ELEMENTS = 300_000  # float32: 1.2 MB, well above 1 MiB


def _payload(who: bytes, i: int) -> np.ndarray:
    """Small array whose values identify the sender and the message."""
    return np.full(5, i, dtype=np.int64) + (1000 * who[-1])


def _big(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(BIG_ELEMENTS).astype(np.float32)


class _EchoServer:
    """Decodes each request and replies with the peer identity it saw and the request echoed."""

    def __init__(self, endpoint: str, curve: CurveKeys | None = None) -> None:
        self.router = RouterSocket(endpoint, self.on_message, curve=curve)
        self.frame_counts: list[int] = []

    def on_message(self, peer: bytes, frames: list) -> None:
        assert all(isinstance(f, memoryview) for f in frames)
        self.frame_counts.append(len(frames))
        request = decode(frames)
        self.router.send(peer, encode({"peer": peer, "echo": request}))


class _Client:
    """Collects decoded replies; resolves ``done`` once ``expected`` replies arrived."""

    def __init__(self, endpoint: str, identity: bytes, expected: int, curve: CurveKeys | None = None) -> None:
        self.dealer = DealerSocket(endpoint, self.on_message, identity=identity, curve=curve)
        self.replies: list = []
        self.expected = expected
        self.done = asyncio.get_running_loop().create_future()

    def on_message(self, frames: list) -> None:
        assert all(isinstance(f, memoryview) for f in frames)
        self.replies.append(decode(frames))
        if len(self.replies) == self.expected and not self.done.done():
            self.done.set_result(None)


async def _echo_round_trip(endpoint: str, curve: CurveKeys | None = None) -> _EchoServer:
    server = _EchoServer(endpoint, curve)
    server.router.bind()
    clients = []
    try:
        for identity in (b"client-a", b"client-b"):
            client = _Client(server.router.endpoint, identity, N_IN_FLIGHT + 1, curve)
            client.dealer.connect()
            clients.append(client)
        # Everything is in flight before any reply is awaited.
        for i in range(N_IN_FLIGHT):
            for client in clients:
                client.dealer.send(encode({"i": i, "x": _payload(client.dealer.identity, i)}))
        for seed, client in enumerate(clients):
            client.dealer.send(encode({"i": "big", "x": _big(seed)}))
        await asyncio.wait_for(asyncio.gather(*(c.done for c in clients)), HANG_GUARD_S)

        for seed, client in enumerate(clients):
            identity = client.dealer.identity
            assert len(client.replies) == N_IN_FLIGHT + 1
            for i, reply in enumerate(client.replies[:N_IN_FLIGHT]):  # one connection keeps order
                assert reply["peer"] == identity
                assert reply["echo"]["i"] == i
                assert np.array_equal(reply["echo"]["x"], _payload(identity, i))
            big = client.replies[-1]["echo"]
            assert big["i"] == "big"
            assert big["x"].dtype == np.float32 and big["x"].tobytes() == _big(seed).tobytes()
        # Small requests are one frame; the big array travelled as its own frame.
        assert sorted(server.frame_counts).count(1) == 2 * N_IN_FLIGHT
        assert sorted(server.frame_counts).count(2) == 2
    finally:
        for client in clients:
            client.dealer.close()
        server.router.close()
    return server


async def test_ipc_echo_two_dealers_and_socket_file_removed(tmp_path: Path) -> None:
    directory = tmp_path / "not" / "yet" / "there"
    endpoint = ipc_endpoint(directory, "actor.sock")
    assert endpoint == f"ipc://{directory}/actor.sock"
    server = _EchoServer(endpoint)
    server.router.bind()
    try:
        assert (directory / "actor.sock").exists()  # bind created the directory
    finally:
        server.router.close()
    assert not (directory / "actor.sock").exists()

    await _echo_round_trip(ipc_endpoint(tmp_path / "run", "echo.sock"))
    assert not (tmp_path / "run" / "echo.sock").exists()


async def test_tcp_loopback_echo_two_dealers(curve_keys: CurveKeys) -> None:
    endpoint = tcp_loopback_endpoint(0)
    assert endpoint == "tcp://127.0.0.1:0"
    server = await _echo_round_trip(endpoint, curve_keys)
    host, port = server.router.endpoint.removeprefix("tcp://").rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


async def test_large_torch_tensor_frame_round_trip(tmp_path: Path) -> None:
    t = torch.from_numpy(_big(7)).to(torch.bfloat16).reshape(600, 500)  # 600 KB x 2 in one message
    received: asyncio.Future = asyncio.get_running_loop().create_future()
    router = RouterSocket(ipc_endpoint(tmp_path, "t.sock"), lambda peer, frames: router.send(peer, frames))
    dealer = DealerSocket(ipc_endpoint(tmp_path, "t.sock"), received.set_result)
    router.bind()
    dealer.connect()
    try:
        dealer.send(encode({"w": t, "w2": t[:, ::2]}))
        frames = await asyncio.wait_for(received, HANG_GUARD_S)
        assert len(frames) == 3
        out = decode(frames)
        assert torch.equal(out["w"].view(torch.int16), t.view(torch.int16))
        assert torch.equal(out["w2"].view(torch.int16), t[:, ::2].contiguous().view(torch.int16))
    finally:
        dealer.close()
        router.close()


async def test_dealer_connecting_before_bind_gets_its_messages_through(tmp_path: Path) -> None:
    endpoint = ipc_endpoint(tmp_path, "late.sock")
    got: list = []
    done = asyncio.get_running_loop().create_future()

    def on_reply(frames: list) -> None:
        got.append(decode(frames))
        if len(got) == 3:
            done.set_result(None)

    dealer = DealerSocket(endpoint, on_reply)
    dealer.connect()
    for i in range(3):
        dealer.send(encode(i))  # queued by ZeroMQ until the router exists
    router = RouterSocket(endpoint, lambda peer, frames: router.send(peer, encode(decode(frames) * 10)))
    router.bind()
    try:
        await asyncio.wait_for(done, HANG_GUARD_S)
        assert got == [0, 10, 20]
    finally:
        dealer.close()
        router.close()


async def test_callback_error_goes_to_loop_handler_and_socket_keeps_serving(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    reported: list = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["exception"]))
    seen: list = []
    done = loop.create_future()

    def on_message(peer: bytes, frames: list) -> None:
        value = decode(frames)
        if value == "boom":
            raise ValueError("bad request")
        seen.append(value)
        done.set_result(None)

    router = RouterSocket(ipc_endpoint(tmp_path, "err.sock"), on_message)
    dealer = DealerSocket(router.endpoint, lambda frames: None)
    router.bind()
    dealer.connect()
    try:
        dealer.send(encode("boom"))
        dealer.send(encode("fine"))
        await asyncio.wait_for(done, HANG_GUARD_S)
        assert seen == ["fine"]
        assert len(reported) == 1 and isinstance(reported[0], ValueError)
    finally:
        loop.set_exception_handler(None)
        dealer.close()
        router.close()


async def test_send_to_unknown_peer_and_after_close_raise(tmp_path: Path) -> None:
    router = RouterSocket(ipc_endpoint(tmp_path, "r.sock"), lambda peer, frames: None)
    with pytest.raises(TransportError, match="not bound"):
        router.send(b"nobody", [b"x"])
    router.bind()
    with pytest.raises(TransportError, match="already called"):
        router.bind()
    with pytest.raises(TransportError, match="not connected"):
        router.send(b"nobody", [b"x"])
    with pytest.raises(TransportError, match="no frames"):
        router.send(b"nobody", [])
    router.close()
    router.close()  # idempotent
    assert router.closed
    with pytest.raises(TransportError, match="closed"):
        router.send(b"nobody", [b"x"])
    dealer = DealerSocket(router.endpoint, lambda frames: None)
    dealer.connect()
    dealer.close()
    with pytest.raises(TransportError, match="closed"):
        dealer.send([b"x"])


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://0.0.0.0:0", "tcp://*:5555", "tcp://eth0:5555", "tcp://10.1.2.3:5555", "tcp://[::]:5555"],
)
async def test_non_loopback_tcp_bind_without_keys_is_refused(endpoint: str) -> None:
    router = RouterSocket(endpoint, lambda peer, frames: None)
    with pytest.raises(TransportError, match="CURVE"):
        router.bind()


async def test_a_wildcard_tcp_bind_with_keys_serves_only_key_holders(curve_keys: CurveKeys,
                                                                    tmp_path: Path) -> None:
    """Across hosts an actor listens beyond loopback; CURVE, not the address, admits peers."""
    from replayrl.transport.curve import CurveKeys as Keys
    from replayrl.transport.curve import create_keys

    got: list = []
    router = RouterSocket("tcp://0.0.0.0:0", lambda peer, frames: (
        got.append(bytes(frames[0])), router.send(peer, [b"pong"])), curve=curve_keys)
    router.bind()
    port = router.endpoint.rsplit(":", 1)[1]
    replies: list = []
    reply = asyncio.get_running_loop().create_future()
    dealer = DealerSocket(f"tcp://127.0.0.1:{port}", lambda frames: (
        replies.append(bytes(frames[0])), reply.done() or reply.set_result(None)), curve=curve_keys)
    dealer.connect()
    create_keys(tmp_path / "other")
    stranger = DealerSocket(f"tcp://127.0.0.1:{port}", lambda frames: replies.append(b"stranger"),
                            curve=Keys.load(tmp_path / "other"))
    stranger.connect()
    try:
        stranger.send([b"from a stranger"])
        dealer.send([b"ping"])
        await asyncio.wait_for(reply, 30)
        await asyncio.sleep(0.2)  # a stranger's message would have arrived by now
    finally:
        dealer.close()
        stranger.close()
        router.close()
    assert got == [b"ping"] and replies == [b"pong"]


async def test_loopback_variants_bind(curve_keys: CurveKeys) -> None:
    for endpoint in ("tcp://localhost:0", "tcp://127.0.0.2:0", "tcp://[::1]:0"):
        router = RouterSocket(endpoint, lambda peer, frames: None, curve=curve_keys)
        try:
            router.bind()
        except TransportError as exc:  # host without IPv6 loopback: the refusal must not be ours
            assert "CURVE" not in str(exc)
        finally:
            router.close()


def test_endpoint_helpers_validate() -> None:
    long_dir = "/tmp/" + "d" * 100
    with pytest.raises(TransportError, match="AF_UNIX limit of 107"):
        ipc_endpoint(long_dir, "x.sock")
    with pytest.raises(TransportError, match="AF_UNIX limit"):
        RouterSocket(f"ipc://{long_dir}/x.sock", lambda peer, frames: None).bind()
    for bad_name in ("", "a/b", "..", "a\0b"):
        with pytest.raises(TransportError, match="one non-empty path component"):
            ipc_endpoint("/tmp", bad_name)
    assert ipc_endpoint("relative/dir", "s") == f"ipc://{os.getcwd()}/relative/dir/s"
    assert tcp_loopback_endpoint(5555) == "tcp://127.0.0.1:5555"
    for bad_port in (-1, 65536, "80"):
        with pytest.raises(TransportError, match="port"):
            tcp_loopback_endpoint(bad_port)
    with pytest.raises(TransportError, match="unsupported transport"):
        RouterSocket("udp://127.0.0.1:1", lambda peer, frames: None).bind()
    with pytest.raises(TransportError, match="identity"):
        DealerSocket("ipc:///tmp/x", lambda frames: None, identity=b"\0reserved")


def test_outside_a_running_loop_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TransportError, match="running asyncio event loop"):
        RouterSocket(ipc_endpoint(tmp_path, "x.sock"), lambda peer, frames: None).bind()
    with pytest.raises(TransportError, match="running asyncio event loop"):
        DealerSocket(ipc_endpoint(tmp_path, "x.sock"), lambda frames: None).connect()


def test_echo_under_uvloop(tmp_path: Path) -> None:
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_echo_round_trip(ipc_endpoint(tmp_path, "uv.sock")))
    assert not (tmp_path / "uv.sock").exists()


async def test_messages_to_a_peer_that_left_raise_peer_unreachable_or_go_to_on_unreachable(
        tmp_path: Path) -> None:
    # a server's replies to a caller that closed its socket (a launcher stopping with calls in
    # flight): the first of a loop iteration raises PeerUnreachable, a queued one goes to
    # on_unreachable, not to the loop's exception handler (which asyncio logs as an ERROR)
    loop = asyncio.get_running_loop()
    reported: list = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    peers: list[bytes] = []
    unreachable: list = []
    router = RouterSocket(ipc_endpoint(tmp_path, "gone.sock"), lambda peer, frames: peers.append(peer),
                          on_unreachable=lambda peer, exc: unreachable.append((peer, exc)))
    router.bind()
    leaving = DealerSocket(router.endpoint, lambda frames: None)
    staying = DealerSocket(router.endpoint, lambda frames: None)
    try:
        for dealer in (leaving, staying):
            dealer.connect()
            dealer.send([b"hello"])
        deadline = loop.time() + HANG_GUARD_S
        while len(peers) < 2:
            assert loop.time() < deadline
            await asyncio.sleep(0.01)
        gone, kept = peers
        leaving.close()
        while True:  # ZeroMQ's I/O thread drops the route shortly after the close
            try:
                router.send(gone, [b"reply"])
            except PeerUnreachable as exc:
                assert isinstance(exc, TransportError) and "not connected" in str(exc)
                break
            assert loop.time() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)  # a fresh loop iteration: the next send goes at once
        router.send(kept, [b"first"])  # goes at once
        router.send(gone, [b"queued"])  # waits for the iteration's end, then finds no peer
        await asyncio.sleep(0.05)
        assert [peer for peer, _ in unreachable] == [gone]
        assert isinstance(unreachable[0][1], PeerUnreachable)
        assert reported == []
    finally:
        loop.set_exception_handler(None)
        staying.close()
        router.close()
