"""Bad input and load against live actors (docs/design/transport.md#transport-contract,
docs/design/actors.md#actor-contract): oversized and amplifying frames, floods, dead peers, peers
without the run's CURVE key, killed launchers. Every wait is a hang guard; nothing asserts on
timing."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import zmq

from replayrl.actors import ActorServer, ActorSpec, Directory, RemoteError, Supervisor, close_connections
from replayrl.actors.actor import Actor
from replayrl.actors.errors import PeerLost
from replayrl.actors.interface import RUNTIME_NAMES
from replayrl.actors.ref import POOL
from replayrl.transport import Codec, DealerSocket, RouterSocket, TransportError, ipc_endpoint
from replayrl.transport.curve import CurveKeys, create_keys
from tests.actor_fixtures import EchoActor
from tests.child_env import PYTHONPATH
from tests.paths import REPO

ECHO = "tests.actor_fixtures:EchoActor"
GUARD_S = 60


@pytest.fixture
def run_dir():
    import tempfile
    with tempfile.TemporaryDirectory(prefix="rrl-") as d:  # short path: AF_UNIX limit
        yield d


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _raw_reply(endpoint: str, frames: list, curve: CurveKeys | None = None) -> dict:
    replies: asyncio.Queue = asyncio.Queue()
    raw = DealerSocket(endpoint, replies.put_nowait, curve=curve)
    raw.connect()
    try:
        raw.send(frames)
        return Codec().decode(await asyncio.wait_for(replies.get(), GUARD_S))
    finally:
        raw.close()


async def test_amplifying_and_many_part_frames_are_refused_with_short_errors(run_dir):
    directory = Directory.for_run(run_dir, ["a"])
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir):
        ref = directory.ref("a")
        envelope = Codec().encode({"k": "call", "id": 7, "m": "echo", "a": [None], "kw": {}})[0]
        # 200,000 parts, none referenced: refused by the frame limit, the reply stays short
        reply = await _raw_reply(directory.endpoint("a"), [envelope] + [b""] * 199_999)
        assert reply["k"] == "err" and reply["id"] == 7 and reply["t"] == "MessageTooLarge"
        assert len(reply["msg"]) < 500 and "max_frames" in reply["msg"]
        # one array of 2**20 empty lists (one 0x90 byte each): refused by the decoder's budget
        n = 1 << 20
        bomb = (b"\x85\xa1k\xa4call\xa2id\x08\xa1m\xa4echo\xa2kw\x80\xa1a\x91"
                + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n)
        reply = await _raw_reply(directory.endpoint("a"), [bomb])
        assert reply["id"] == 8 and reply["t"] == "MessageTooLarge" and "budget" in reply["msg"]
        assert await ref.call("echo", "still serving", timeout=GUARD_S) == "still serving"


async def test_base_class_names_are_not_remote(run_dir):
    assert RUNTIME_NAMES == {n for n in dir(Actor) if not n.startswith("_")}
    directory = Directory.for_run(run_dir, ["a"])
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir):
        for name in sorted(RUNTIME_NAMES):
            with pytest.raises(RemoteError, match=f"no public async method '{name}'"):
                await directory.ref("a").call(name, timeout=GUARD_S)
        interface = await directory.proxy("a", GUARD_S).interface()
        assert not RUNTIME_NAMES & set(interface.signatures)
        assert await directory.ref("a").call("echo", 1, timeout=GUARD_S) == 1  # still serving


async def test_ten_thousand_calls_are_held_to_the_in_flight_limit(run_dir):
    server = ActorServer(EchoActor(), ipc_endpoint(run_dir, "a"))
    peak = 0
    original = server._queue.put_nowait

    def counting_put(item):
        nonlocal peak
        original(item)
        peak = max(peak, server._queue.qsize())

    server._queue.put_nowait = counting_put
    server.start()
    try:
        ref = Directory({"a": server.endpoint}).ref("a")
        results = await asyncio.wait_for(asyncio.gather(*(ref.call("echo", i) for i in range(10_000))),
                                         GUARD_S)
        assert results == list(range(10_000))
        assert 0 < peak <= POOL.max_in_flight  # never more queued at the actor than one caller's limit
    finally:
        close_connections()
        server.close()


async def test_an_actor_refuses_calls_beyond_its_pending_limit_and_loses_none(run_dir, monkeypatch):
    monkeypatch.setattr(POOL, "max_in_flight", 10_000)  # a caller that ignores backpressure
    server = ActorServer(EchoActor(), ipc_endpoint(run_dir, "a"), max_pending=16)
    server.start()
    try:
        ref = Directory({"a": server.endpoint}).ref("a")
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(ref.call("sleep", 0.01) for _ in range(200)), return_exceptions=True), GUARD_S)
        refused = [o for o in outcomes if isinstance(o, RemoteError)]
        assert all(o.remote_type == "Overloaded" for o in refused)
        assert len(refused) + outcomes.count("slept") == 200
        assert outcomes.count("slept") >= 16 and refused  # the first 16 ran; the flood was refused
    finally:
        close_connections()
        server.close()


async def test_calls_without_timeout_fail_when_the_peer_dies(run_dir):
    directory = Directory.for_run(run_dir, ["a"])
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir) as sup:
        ref = directory.ref("a")
        calls = [asyncio.ensure_future(ref.call("sleep", 600)) for _ in range(2000)]  # no timeout
        await asyncio.sleep(0.5)
        os.kill(sup.processes["a"].pid, signal.SIGKILL)
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), GUARD_S)
        assert all(isinstance(o, PeerLost) for o in outcomes), {type(o).__name__ for o in outcomes}
        assert "connection lost" in str(outcomes[0])


async def test_tensors_reach_a_torch_free_actor_without_importing_torch(run_dir):
    directory = Directory.for_run(run_dir, ["a"])
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir):
        ref = directory.ref("a")
        assert await ref.call("torch_imported", timeout=GUARD_S) is False
        x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
        assert await ref.call("type_name", x, timeout=GUARD_S) == "TensorData"
        back = await ref.call("echo", {"x": x, "y": torch.zeros(0, 5)}, timeout=GUARD_S)  # relayed
        assert back["x"].dtype == torch.bfloat16 and torch.equal(back["x"], x)
        assert back["y"].shape == (0, 5)
        assert await ref.call("torch_imported", timeout=GUARD_S) is False


def test_ipc_directories_must_be_private(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)

    async def bind(directory: Path) -> None:
        router = RouterSocket(ipc_endpoint(directory, "a"), lambda peer, frames: None)
        try:
            router.bind()
        finally:
            router.close()

    with pytest.raises(TransportError, match="mode 755"):
        asyncio.run(bind(open_dir))
    asyncio.run(bind(tmp_path / "new"))
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700


async def test_frames_over_the_socket_limit_are_dropped_before_delivery(run_dir):
    seen: list[int] = []
    router = RouterSocket(ipc_endpoint(run_dir, "r"), lambda peer, frames: seen.append(len(frames[0])),
                          max_message_bytes=1 << 20)
    router.bind()
    try:
        for size in (2 << 20, 100):
            dealer = DealerSocket(router.endpoint, lambda frames: None)
            dealer.connect()
            dealer.send([b"\x00" * size])
            if size == 100:
                while not seen:
                    await asyncio.sleep(0.01)
            else:
                await asyncio.sleep(0.5)  # what could arrive would have; the next message proves liveness
            dealer.close()
        assert seen == [100]  # the 2 MiB frame never reached on_message
    finally:
        router.close()


def _handshake_events(sock: zmq.Socket, monitor: zmq.Socket) -> list[int]:
    """Monitor events of ``sock`` until its handshake succeeded or failed (hang-guarded)."""
    done = {zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}
    events: list[int] = []
    while not done & set(events) and monitor.poll(GUARD_S * 1000):
        events.append(zmq.utils.monitor.recv_monitor_message(monitor)["event"])
    return events


async def test_peers_without_the_run_key_cannot_call_anything(run_dir, curve_keys_dir, tmp_path):
    directory = Directory.for_run(run_dir, ["a"], transport="tcp", curve_keys=curve_keys_dir)
    run_key = directory.keys()
    stranger = CurveKeys.load(create_keys(tmp_path / "stranger").parent)
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir):
        request = Codec().encode({"k": "call", "id": 1, "m": "record", "a": [99], "kw": {}})
        peers = {"no CURVE": None, "another key pair": stranger, "the run's public key only": "public"}
        for what, keys in peers.items():
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.linger = 0
            monitor = sock.get_monitor_socket()
            if keys is not None:  # it knows the server's public key (run.key is not secret)
                sock.curve_serverkey = run_key.public
                sock.curve_publickey = run_key.public if keys == "public" else keys.public
                sock.curve_secretkey = stranger.secret if keys == "public" else keys.secret
            sock.connect(directory.endpoint("a"))
            sock.send_multipart(request)
            try:
                events = await asyncio.to_thread(_handshake_events, sock, monitor)
                assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, what
                assert sock.poll(100) == 0, what  # no reply
            finally:
                sock.disable_monitor()
                monitor.close(0)
                sock.close(0)
        # the run's own key still works, and nothing the strangers sent was executed
        assert await directory.ref("a").call("recorded", timeout=GUARD_S) == []


async def test_calls_over_a_refused_handshake_fail_with_peer_lost(run_dir, curve_keys_dir, tmp_path):
    directory = Directory.for_run(run_dir, ["a"], transport="tcp", curve_keys=curve_keys_dir)
    async with Supervisor([ActorSpec("a", ECHO)], directory, run_dir):
        lost: asyncio.Future = asyncio.get_running_loop().create_future()
        wrong = CurveKeys.load(create_keys(tmp_path / "wrong").parent)
        dealer = DealerSocket(directory.endpoint("a"), lambda frames: None, curve=wrong,
                              on_disconnect=lambda why: lost.done() or lost.set_result(why))
        dealer.connect()
        try:
            assert "handshake refused" in await asyncio.wait_for(lost, GUARD_S)
            assert dealer.lost is not None
        finally:
            dealer.close()


def test_no_pickle_on_the_wire():
    import ast

    banned_modules = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
    banned_calls = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"}
    # a parent hands the child it starts its call over an anonymous pipe only the two hold (as
    # multiprocessing's spawn does): not the wire, which a peer can reach
    parent_to_child = REPO / "actors" / "child_process.py"
    for package in ("transport", "actors", "rollout", "trainer", "tools"):
        for path in (REPO / package).rglob("*.py"):
            if path == parent_to_child:
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    names = {(node.module or "").split(".")[0]}
                else:
                    names = set()
                assert not names & banned_modules, f"{path}: imports {names & banned_modules}"
                if isinstance(node, ast.Attribute):
                    assert node.attr not in banned_calls, f"{path}:{node.lineno}: {node.attr}"
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load" \
                        and getattr(node.func.value, "id", None) == "torch":
                    kwargs = {k.arg: k.value for k in node.keywords}
                    assert isinstance(kwargs.get("weights_only"), ast.Constant) \
                        and kwargs["weights_only"].value is True, \
                        f"{path}:{node.lineno}: torch.load without weights_only"


def test_killed_launcher_leaves_no_run_directory(tmp_path):
    script = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(REPO)!r})
        from replayrl.actors import ActorSpec, Directory, Supervisor, run_event_loop
        from replayrl.actors.run_dir import create_run_dir

        async def main():
            run_dir = create_run_dir()
            directory = Directory.for_run(run_dir, ["a", "b"])
            async with Supervisor([ActorSpec("a", {ECHO!r}), ActorSpec("b", {ECHO!r})], directory, run_dir) as sup:
                print(run_dir, *(p.pid for p in sup.processes.values()), flush=True)
                await asyncio.sleep(600)

        run_event_loop(main())
    """)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": PYTHONPATH}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        run_dir, *pids = proc.stdout.readline().split()
        assert Path(run_dir).parent == tmp and len(pids) == 2
        proc.kill()  # SIGKILL: no cleanup code of the launcher runs
        proc.wait(GUARD_S)
        for pid in map(int, pids):  # the actors notice and exit on their own
            for _ in range(GUARD_S * 10):
                if not _alive(pid):
                    break
                time.sleep(0.1)
            assert not _alive(pid)
        assert list(tmp.iterdir()) == []
    finally:
        proc.kill()


def test_the_id_of_a_refused_message_is_read_without_decoding_it():
    import tracemalloc

    import msgpack

    from replayrl.actors.actor import _best_effort_id

    n = 1 << 20
    bomb = (b"\x85\xa1a\x91" + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
            + b"\xa1k\xa4call\xa2id\x08\xa1m\xa4echo\xa2kw\x80")  # the bulk comes before the id
    tracemalloc.start()
    assert _best_effort_id([bomb]) == 8
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * len(bomb)  # the unpacker's copy of the bytes; the 2**20 lists (64x) never built
    assert _best_effort_id([msgpack.packb({"k": "tell", "id": 3})]) is None  # no reply to a tell
    assert _best_effort_id([b"\xc1"]) is None and _best_effort_id([msgpack.packb([1, 2])]) is None
    assert _best_effort_id([msgpack.packb({"k": "call", "id": True})]) is None


def test_error_logs_are_rate_limited_and_count_what_they_suppressed():
    import logging

    from replayrl.actors.log_limit import MAX_ERROR_TEXT, RateLimitedLog, clip

    now = [0.0]
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test.rate_limited")
    logger.addHandler(Collect())
    limited = RateLimitedLog(logger, per_second=1.0, burst=3, clock=lambda: now[0])
    logged = [limited.log(logging.ERROR, f"bad message {i} " + "x" * 10_000) for i in range(1000)]
    assert logged.count(True) == 3 and len(records) == 3  # the burst, then nothing
    now[0] += 2.0  # two tokens back
    assert limited.log(logging.ERROR, "after the flood")
    assert records[-1].startswith("after the flood") and "997 similar lines suppressed" in records[-1]
    assert all(len(r) <= MAX_ERROR_TEXT + 100 for r in records)
    assert clip("abc" * 1000, 30, keep_end=True).endswith("abc" * 10)


def test_keys_command_writes_a_private_key_pair_once(tmp_path, capsys):
    import stat

    from replayrl.tools.cli import main

    assert main(["keys", str(tmp_path / "k")]) == 0
    secret = tmp_path / "k" / "run.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    keys = CurveKeys.load(tmp_path / "k")
    assert len(keys.public) == len(keys.secret) == 40 and str(keys.secret) not in repr(keys)
    assert main(["keys", str(tmp_path / "k")]) != 0  # never overwritten
    assert CurveKeys.load(tmp_path / "k") == keys
    secret.chmod(0o644)
    with pytest.raises(TransportError, match="chmod 600"):
        CurveKeys.load(tmp_path / "k")
