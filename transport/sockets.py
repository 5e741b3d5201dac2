"""Asynchronous ZeroMQ sockets driven by the event loop's reader callback.

A plain (blocking-API) ZeroMQ socket is registered with ``loop.add_reader`` on its ``zmq.FD``;
each wake-up drains every ready message with non-blocking receives and hands each one to a
synchronous ``on_message`` callback. docs/design/transport.md#transport-contract records this at 36k RPC/s
with 64 in flight versus
12k/s for one ``await recv`` per message with ``zmq.asyncio``. Works with the standard loop and
uvloop.

ZeroMQ's FD is edge-triggered and only says "look at ZMQ_EVENTS": it can be reset by any
``send``/``getsockopt(EVENTS)`` without a receive, so a message could sit unseen. Hence the socket
is drained once right after registration and again (``loop.call_soon``) after every send, and a
drain only stops when ``ZMQ_EVENTS`` shows no ``POLLIN``.

Batches (docs/design/transport.md#shm-transport): the first message a socket sends
in a loop iteration leaves at once; those sent after it in the same iteration wait for the
iteration's end (one ``call_soon``), where runs of small single-frame messages to one peer leave
as one batch frame (:mod:`replayrl.transport.batch`), and anything else alone, all in order. A burst of N
calls or replies thus costs one ZeroMQ message, one wake-up of libzmq's I/O thread and one of
the receiver, instead of N; a lone message waits for nothing. The reader splits a batch and
hands each message to ``on_message`` as if it had come alone; a malformed batch is refused
whole (``on_bad_batch``). A ROUTER's queued message to a peer that is gone by the iteration's
end is reported to the loop's exception handler (``send`` itself raises only for the first).

Frames given to ``on_message`` are ``memoryview`` objects (``zmq.Frame.buffer``, received with
``copy=False``): zero copy, they keep the ZeroMQ message alive, and ``replayrl.transport.codec.decode``
accepts them directly.

A message is the sender's no longer once ``send`` returns: ZeroMQ reads a frame later, from its
I/O thread, so a frame that aliases the caller's memory (the codec's out-of-band frames are
views of the encoded arrays) would carry whatever the caller writes there afterwards, a torn
message with no error. ``send`` therefore copies every frame that is not immutable ``bytes``
into bytes the transport owns (:func:`owned_frames`) and hands those to ZeroMQ by reference
(``copy=False``). That is one memcpy per large frame (measured by ``replayrl bench transport``);
``bytes`` frames, e.g. from :func:`owned_frames` at an earlier snapshot, are not copied again.

Options: LINGER 0 (``close`` discards messages not yet sent), SNDHWM/RCVHWM 0 (unlimited: sends
never block or drop; memory is bounded by the callers' in-flight limits), MAXMSGSIZE
``max_message_bytes``: libzmq drops the connection of a peer announcing a larger frame before
buffering it (the codec then bounds the sum of the frames).

Security (docs/design/transport.md#transport-contract): a ``tcp://`` socket needs the run's
:class:`replayrl.transport.curve.CurveKeys` (CurveZMQ encryption and authentication, a ZAP handler that
admits only the run's key) and refuses to bind or connect without them; an ``ipc://`` socket
binds only inside a directory of mode 0700 owned by this user (created so when missing).

Liveness: a DealerSocket sends ZMTP heartbeats (``heartbeat_ms``; libzmq's I/O thread answers
them even while the peer's Python code is busy) and watches its connection through a socket
monitor, so ``on_disconnect`` runs when the peer's process dies or stops answering heartbeats,
and a caller can fail the calls that can no longer be answered. One socket per peer,
not per request (docs/design/transport.md#transport-contract): a ``DealerSocket`` per remote actor, one
``RouterSocket`` per actor.

All methods must be called from the thread running the event loop the socket was opened in.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.monitor

from replayrl.transport.batch import (
    BATCH_MARKER,
    MAX_BATCH_BYTES,
    MAX_BATCH_ELEMENT_BYTES,
    MAX_BATCH_MESSAGES,
    batch_overhead,
    is_batch,
    pack_batch,
    split_batch,
)
from replayrl.transport.codec import DEFAULT_INLINE_THRESHOLD, DEFAULT_MAX_MESSAGE_BYTES
from replayrl.transport.curve import CurveKeys, authorize
from replayrl.transport.endpoints import (
    check_bind_endpoint,
    check_connect_endpoint,
    ipc_endpoint,
    tcp_loopback_endpoint,
)
from replayrl.transport.errors import DecodeError, PeerUnreachable, TransportError
from replayrl.transport.shm_pool import ShmHeader, mark_sent, release_unread

__all__ = ["RouterSocket", "DealerSocket", "ipc_endpoint", "tcp_loopback_endpoint", "owned_frames",
           "MAX_MESSAGES_PER_WAKEUP", "DEFAULT_HEARTBEAT_MS"]

DEFAULT_HEARTBEAT_MS = (2000, 30000)
"""A DealerSocket's ZMTP heartbeat: a PING every 2 s, the connection dropped (and
``on_disconnect`` run) after 30 s without traffic from the peer; unit: milliseconds."""

MAX_MESSAGES_PER_WAKEUP = 4096
"""A drain hands at most this many messages to ``on_message`` before yielding to the loop (and
rescheduling itself), so a flood on one socket cannot starve other tasks."""


# plain ints: pyzmq's enum members make every ``&`` / ``|`` build an enum object (measured
# 16 enum constructions per actor call in cProfile)
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE) | _NOBLOCK


def owned_frames(frames: list[Any]) -> list[bytes]:
    """``frames`` as immutable ``bytes``: a ``bytes`` frame as it is, any other buffer
    (``memoryview``, array, ``bytearray``, ``zmq.Frame``) copied. After this, no write by the
    caller to its arrays or buffers can change the message.

    Raises:
        TypeError: a frame is not a buffer.
    """
    return [f if isinstance(f, bytes) else f.bytes if isinstance(f, zmq.Frame)
            else memoryview(f).tobytes() for f in frames]


def _running_loop(what: str) -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise TransportError(f"{what} must be called from inside a running asyncio event loop") from None


class _LoopSocket:
    """Shared machinery: a plain zmq socket whose FD is watched by the running loop."""

    def __init__(self, endpoint: str, context: zmq.Context | None, curve: CurveKeys | None,
                 max_message_bytes: int) -> None:
        if context is not None and not isinstance(context, zmq.Context):
            raise TransportError(f"context must be a zmq.Context, got {type(context).__name__}")
        if curve is not None and not isinstance(curve, CurveKeys):
            raise TransportError(f"curve must be CurveKeys, got {type(curve).__name__}")
        if type(max_message_bytes) is not int or max_message_bytes <= 0:
            raise TransportError(f"max_message_bytes must be an int > 0, got {max_message_bytes!r}")
        self._endpoint = endpoint
        self._context = context
        self._curve = curve
        self._max_message_bytes = max_message_bytes
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None
        self._drain_scheduled = False
        self._closed = False
        self._head = 0  # frames before the message: a ROUTER's peer identity
        self._on_bad_batch: Callable[[bytes | None, DecodeError], None] | None = None
        self._on_unreachable: Callable[[bytes | None, PeerUnreachable], None] | None = None
        # messages sent after the first of a loop iteration, per peer (None for a DEALER)
        self._outbox: dict[bytes | None, list[list[bytes]]] = {}
        self._flush_scheduled = False

    def _open(self, socket_type: int, what: str) -> zmq.Socket:
        if self._closed:
            raise TransportError(f"{type(self).__name__} for {self._endpoint!r} is closed")
        if self._sock is not None:
            raise TransportError(f"{type(self).__name__} for {self._endpoint!r}: {what}() was already called")
        self._loop = _running_loop(f"{type(self).__name__}.{what}()")
        ctx = self._context if self._context is not None else zmq.Context.instance()
        # zmq.Socket(ctx, ...) yields a plain socket even for a zmq.asyncio.Context.
        sock = zmq.Socket(ctx, socket_type)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        # With copy=False, pyzmq still copies frames under this size: below it a copy is cheaper
        # than pinning the buffer (and matches the codec's inline threshold).
        sock.copy_threshold = DEFAULT_INLINE_THRESHOLD
        return sock

    def _secure(self, sock: zmq.Socket, scheme: str, server: bool) -> None:
        """CURVE on tcp (refused without keys); nothing on ipc / inproc."""
        if scheme != "tcp":
            return
        if self._curve is None:
            raise TransportError(
                f"{self._endpoint}: a tcp socket needs the run's CURVE keys (other local users reach "
                "loopback too); make them with `replayrl keys DIR` and pass --curve-keys DIR")
        if server:
            authorize(sock.context, self._curve)
            sock.curve_server = True
        else:
            sock.curve_serverkey = self._curve.public
        sock.curve_publickey = self._curve.public
        sock.curve_secretkey = self._curve.secret

    def _register(self, sock: zmq.Socket) -> None:
        assert self._loop is not None
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()  # messages may already be queued; the edge may have passed

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self._closed:
            self._drain_scheduled = True
            self._loop.call_soon(self._scheduled_drain)

    def _scheduled_drain(self) -> None:
        self._drain_scheduled = False
        self._drain()

    def _drain(self) -> None:
        count = 0
        head = self._head
        sock = self._sock
        while not self._closed and sock.getsockopt(_EVENTS) & _POLLIN:
            if count >= MAX_MESSAGES_PER_WAKEUP:
                self._schedule_drain()
                return
            try:
                frame = sock.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            frames = [frame]
            while frame.more:  # the rest of a multipart message is already here
                frame = sock.recv(_NOBLOCK, copy=False)
                frames.append(frame)
            peer = frames[0].bytes if head else None
            if len(frames) == head + 1 and is_batch(frames[head].buffer):
                try:
                    messages = [[view] for view in split_batch(frames[head].buffer)]
                except DecodeError as exc:  # refused whole: nothing of it was delivered
                    count += 1
                    self._report(peer, exc)
                    continue
            else:
                messages = [[f.buffer for f in frames[head:]]]
            count += len(messages)
            for views in messages:
                try:
                    self._deliver(peer, views)
                except Exception as exc:
                    # The socket keeps serving: report through the loop's exception handler
                    # (logged by default) instead of losing the reader callback.
                    self._loop.call_exception_handler(
                        {"message": f"{type(self).__name__} on_message callback failed", "exception": exc,
                         "socket": self})

    def _report(self, peer: bytes | None, exc: DecodeError) -> None:
        if self._on_bad_batch is not None:
            try:
                self._on_bad_batch(peer, exc)
                return
            except Exception as hook_exc:
                exc = hook_exc
        self._loop.call_exception_handler(
            {"message": f"{type(self).__name__}: malformed batch from {peer!r}", "exception": exc, "socket": self})

    def _deliver(self, peer: bytes | None, views: list[memoryview]) -> None:
        raise NotImplementedError

    def _send(self, frames: list[Any], peer: bytes | None, peer_text: str) -> None:
        if self._sock is None or self._closed:
            state = "closed" if self._closed else "not bound/connected yet"
            raise TransportError(f"{type(self).__name__} for {self._endpoint!r} is {state}")
        if type(frames[0]) is ShmHeader and frames[0].discarded:
            raise TransportError(f"message to {peer_text} was discarded: its shared-memory slots "
                                 "were released and may hold another message now")
        # owned bytes: the caller may reuse its buffers as soon as we return
        owned = owned_frames(frames)
        if self._outbox or self._flush_scheduled:
            # not the first message of this loop iteration: it waits for the iteration's end,
            # where every message queued meanwhile leaves in as few ZeroMQ messages as possible
            self._outbox.setdefault(peer, []).append(owned)
            return
        self._send_now(peer, _alone(owned), owned[:1], peer_text)  # the first goes at once: no added latency
        self._flush_scheduled = True
        self._loop.call_soon(self._tick)

    def _send_now(self, peer: bytes | None, owned: list[bytes], headers: list[bytes], peer_text: str) -> None:
        try:
            # owned bytes by reference (copy=False)
            sock = self._sock
            if peer is not None:
                sock.send(peer, _SNDMORE)
            for frame in owned[:-1]:
                sock.send(frame, _SNDMORE, copy=False)
            sock.send(owned[-1], _NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachable(f"{self._endpoint}: peer {peer_text} is not connected") from exc
            raise TransportError(f"{self._endpoint}: send to {peer_text} failed: {exc}") from exc
        mark_sent(headers)  # a message's shared-memory slots are the receiver's to release now

    def _tick(self) -> None:
        """End of a loop iteration with sends: flush what was queued, then drain (a send may
        have consumed the FD's edge for incoming messages)."""
        self._flush_scheduled = False
        if self._closed:
            return
        outbox, self._outbox = self._outbox, {}
        for peer, messages in outbox.items():
            try:
                for owned, headers in _coalesce(messages, min(MAX_BATCH_BYTES, self._max_message_bytes)):
                    self._send_now(peer, owned, headers, repr(peer) if peer is not None else self._endpoint)
            except PeerUnreachable as exc:  # the peer left: the rest for it is dropped too
                if self._on_unreachable is None:
                    self._loop.call_exception_handler(
                        {"message": f"{type(self).__name__}: queued messages not sent",
                         "exception": exc, "socket": self})
                else:
                    self._on_unreachable(peer, exc)
            except TransportError as exc:  # the rest for this peer is dropped (slots released)
                self._loop.call_exception_handler(
                    {"message": f"{type(self).__name__}: queued messages not sent", "exception": exc,
                     "socket": self})
        self._drain()

    def _close_socket(self) -> bool:
        if self._closed:
            return False
        self._closed = True
        if self._sock is not None:
            if self._fd is not None and self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            self._sock.close(linger=0)
        self._outbox = {}  # discarded as LINGER 0 discards: their shared-memory slots are released
        return True

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closed


class RouterSocket(_LoopSocket):
    """Server side of one actor: a ZeroMQ ROUTER bound to ``endpoint``.

    Args:
        endpoint: ``ipc://path`` (see :func:`ipc_endpoint`), ``tcp://<loopback>:port`` (see
            :func:`tcp_loopback_endpoint`) or ``inproc://name``.
        on_message: ``on_message(peer_identity: bytes, frames: list[memoryview])`` called
            synchronously from the loop's reader callback for every received message, in arrival
            order. Exceptions it raises go to the loop's exception handler; the socket goes on.
        context: ZeroMQ context; default ``zmq.Context.instance()`` (never terminated here).
        curve: the run's CURVE keys; required for ``tcp://``.
        max_message_bytes: largest frame accepted from a peer (ZMQ_MAXMSGSIZE); bytes.
        on_bad_batch: ``on_bad_batch(peer_identity, error)``, called for a malformed batch
            (:func:`replayrl.transport.batch.split_batch`'s ``DecodeError``, naming the element), which
            is refused whole; default: the loop's exception handler.
        on_unreachable: ``on_unreachable(peer_identity, error)``, called for messages queued to a
            peer that disconnected before the end of the loop iteration sent them
            (:class:`replayrl.transport.errors.PeerUnreachable`; they are dropped); default: the
            loop's exception handler.

    Options besides the shared ones (module docstring): ROUTER_MANDATORY, so ``send`` to an
    unknown peer raises instead of silently dropping; ROUTER_HANDOVER, so a restarted peer that
    reconnects with the same identity takes over its old route.
    """

    def __init__(
        self,
        endpoint: str,
        on_message: Callable[[bytes, list], None],
        *,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        on_bad_batch: Callable[[bytes | None, DecodeError], None] | None = None,
        on_unreachable: Callable[[bytes | None, PeerUnreachable], None] | None = None,
    ) -> None:
        super().__init__(endpoint, context, curve, max_message_bytes)
        self._on_message = on_message
        self._on_bad_batch = on_bad_batch
        self._on_unreachable = on_unreachable
        self._head = 1
        self._ipc_file: str | None = None
        self._bound_endpoint: str | None = None

    def bind(self) -> None:
        """Bind and start receiving; call inside the running event loop.

        For a file-backed ``ipc://`` endpoint, creates the socket file's directory (mode 0700,
        parents included) if missing; the file is removed again by ``close()``.

        Raises:
            TransportError: not inside a running loop, already bound or closed, bad endpoint
                (see :func:`replayrl.transport.endpoints.check_bind_endpoint`), tcp (any address)
                without CURVE keys, an ipc directory that other users can enter or
                that another user owns, or ZeroMQ refused the bind (address in use...); after a
                refused bind the socket is closed (make a new RouterSocket to retry).
        """
        scheme, ipc_file = check_bind_endpoint(self._endpoint)
        sock = self._open(zmq.ROUTER, "bind")
        try:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._secure(sock, scheme, server=True)
            if ipc_file is not None:
                _private_directory(Path(ipc_file).parent)
            sock.bind(self._endpoint)
            self._bound_endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        except TransportError:
            sock.close(linger=0)
            self._closed = True
            raise
        except (zmq.ZMQError, OSError) as exc:
            sock.close(linger=0)
            self._closed = True
            raise TransportError(f"cannot bind {self._endpoint!r}: {exc}") from exc
        self._ipc_file = ipc_file
        self._register(sock)

    @property
    def endpoint(self) -> str:
        """The endpoint peers connect to: after ``bind()`` the resolved one (a ``tcp://...:0``
        endpoint then carries the port the OS chose), before it the one given."""
        return self._bound_endpoint or self._endpoint

    def send(self, peer: bytes, frames: list) -> None:
        """Queue one message to ``peer`` (an identity received by ``on_message``, or a
        DealerSocket's ``identity``). Returns at once; ZeroMQ sends from its I/O thread, the
        first message of a loop iteration at once, later ones in one batch at its end.

        Args:
            peer: routing identity, bytes.
            frames: one or more ``bytes``/``memoryview``/buffer objects/``zmq.Frame``; anything
                but ``bytes`` is copied before this returns (:func:`owned_frames`), so the caller
                may modify or reuse its buffers at once.

        Raises:
            TransportError: socket not bound or closed, no frames, or ``peer`` not connected
                (:class:`~replayrl.transport.errors.PeerUnreachable`; known at once only for the
                first message of a loop iteration; a later one to a peer that is gone goes to
                ``on_unreachable``, else the loop's exception handler: module docstring,
                "Batches").
        """
        if not isinstance(peer, bytes) or not peer:
            raise TransportError(f"peer identity must be non-empty bytes, got {peer!r}")
        if not frames:
            raise TransportError(f"message to peer {peer!r} has no frames")
        self._send(frames, peer, repr(peer))

    def _deliver(self, peer: bytes | None, views: list[memoryview]) -> None:
        self._on_message(peer, views)

    def close(self) -> None:
        """Stop receiving, close the socket (LINGER 0: unsent messages are discarded) and remove
        the ipc socket file. Idempotent."""
        if self._close_socket() and self._ipc_file is not None:
            try:
                os.unlink(self._ipc_file)
            except FileNotFoundError:  # libzmq may have removed it already
                pass


class DealerSocket(_LoopSocket):
    """Client side: a ZeroMQ DEALER connected to one peer's RouterSocket. Use ONE per peer for
    all requests (docs/design/transport.md#transport-contract), not one per request.

    Args:
        endpoint: the peer's endpoint (any tcp host is accepted for connect; listening is what
            is restricted to loopback).
        on_message: ``on_message(frames: list[memoryview])`` called synchronously from the loop's
            reader callback for every received message, in arrival order. Exceptions it raises go
            to the loop's exception handler; the socket goes on.
        identity: routing identity seen by the router, 1..255 bytes not starting with NUL
            (reserved by ZeroMQ); default: ZeroMQ generates one.
        context: ZeroMQ context; default ``zmq.Context.instance()`` (never terminated here).
        curve: the run's CURVE keys; required for ``tcp://``.
        max_message_bytes: largest frame accepted from the peer (ZMQ_MAXMSGSIZE); bytes.
        on_disconnect: ``on_disconnect(reason: str)``, called from the loop when an established
            connection is lost (peer process gone, heartbeat timeout) or the peer refused the
            handshake (wrong CURVE key); ZeroMQ keeps reconnecting afterwards.
        on_connect: ``on_connect()``, called from the loop after each successful handshake
            (the first connection and every reconnection); only with ``on_disconnect``.
        heartbeat_ms: ``(interval, timeout)`` of ZMTP heartbeats, milliseconds.
        on_bad_batch: ``on_bad_batch(None, error)`` for a malformed batch, as for
            :class:`RouterSocket`.

    Raises:
        TransportError: invalid ``identity`` or ``context``.
    """

    def __init__(
        self,
        endpoint: str,
        on_message: Callable[[list], None],
        *,
        identity: bytes | None = None,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        on_disconnect: Callable[[str], None] | None = None,
        heartbeat_ms: tuple[int, int] = DEFAULT_HEARTBEAT_MS,
        on_connect: Callable[[], None] | None = None,
        on_bad_batch: Callable[[bytes | None, DecodeError], None] | None = None,
    ) -> None:
        if identity is not None and (
            not isinstance(identity, bytes) or not 1 <= len(identity) <= 255 or identity.startswith(b"\0")
        ):
            raise TransportError(f"identity must be 1..255 bytes not starting with NUL, got {identity!r}")
        super().__init__(endpoint, context, curve, max_message_bytes)
        self._on_message = on_message
        self._on_bad_batch = on_bad_batch
        self._identity = identity
        self._on_disconnect = on_disconnect
        self._on_connect = on_connect
        self._heartbeat_ms = heartbeat_ms
        self._monitor: zmq.Socket | None = None
        self._monitor_fd: int | None = None
        self._lost: str | None = None
        self._sent = 0  # messages given to send(), in order: the next one's number
        # (number, slots) of sent messages with shared-memory slots, until peer_read passes them
        self._unread: deque[tuple[int, list]] = deque()

    @property
    def lost(self) -> str | None:
        """Why the connection is down (``on_disconnect``'s reason) until a new handshake
        succeeds; None while connected or before the first connection (only watched when
        ``on_disconnect`` is given)."""
        return self._lost

    @property
    def identity(self) -> bytes | None:
        """The routing identity given at construction (None: chosen by ZeroMQ)."""
        return self._identity

    def connect(self) -> None:
        """Connect and start receiving; call inside the running event loop. Connecting before
        the peer has bound is fine: ZeroMQ reconnects and queues sends meanwhile.

        Raises:
            TransportError: not inside a running loop, already connected or closed, bad
                endpoint, or ZeroMQ refused it (the socket is then closed).
        """
        scheme = check_connect_endpoint(self._endpoint)
        sock = self._open(zmq.DEALER, "connect")
        try:
            if self._identity is not None:
                sock.setsockopt(zmq.ROUTING_ID, self._identity)
            self._secure(sock, scheme, server=False)
            interval, timeout = self._heartbeat_ms
            sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
            if self._on_disconnect is not None:
                self._monitor = sock.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            sock.connect(self._endpoint)
        except (TransportError, zmq.ZMQError) as exc:
            if self._monitor is not None:
                self._monitor.close(linger=0)
            sock.close(linger=0)
            self._closed = True
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"cannot connect to {self._endpoint!r}: {exc}") from exc
        self._register(sock)
        if self._monitor is not None:
            self._monitor_fd = self._monitor.getsockopt(zmq.FD)
            self._loop.add_reader(self._monitor_fd, self._read_monitor)
            self._loop.call_soon(self._read_monitor)  # the FD is edge-triggered, as above

    def _read_monitor(self) -> None:
        while not self._closed and self._monitor is not None:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._lost = None
                if self._on_connect is not None:
                    self._callback(self._on_connect, "on_connect")
                continue
            reason = ("connection lost" if kind == zmq.EVENT_DISCONNECTED
                      else f"handshake refused ({zmq.Event(kind).name})")
            self._lost = f"{self._endpoint}: {reason}"
            self._callback(self._on_disconnect, "on_disconnect", self._lost)

    def _callback(self, callback: Callable, what: str, *args: Any) -> None:
        try:
            callback(*args)
        except Exception as exc:
            self._loop.call_exception_handler(
                {"message": f"DealerSocket {what} callback failed", "exception": exc, "socket": self})

    def send(self, frames: list) -> int:
        """Queue one message to the peer. Returns at once; ZeroMQ sends from its I/O thread, the
        first message of a loop iteration at once, later ones in one batch at its end.

        Args:
            frames: one or more ``bytes``/``memoryview``/buffer objects/``zmq.Frame``; anything
                but ``bytes`` is copied before this returns (:func:`owned_frames`), so the caller
                may modify or reuse its buffers at once.

        Returns:
            the message's number on this socket (0, 1, 2, ... in send order), for
            :meth:`peer_read`.

        Raises:
            TransportError: socket not connected or closed, or no frames.
        """
        if not frames:
            raise TransportError(f"message to {self._endpoint!r} has no frames")
        self._send(frames, None, self._endpoint)
        number = self._sent
        self._sent += 1
        header = frames[0]
        if type(header) is ShmHeader and header.slots:
            self._unread.append((number, header.slots))
        return number

    def peer_read(self, number: int) -> None:
        """The peer answered message ``number`` (:meth:`send`'s return value): so every message
        sent before it was read by that process, or went with a connection that is gone and
        will never reach anyone (a DEALER keeps one ordered pipe per endpoint across
        reconnects: what was still queued goes to the peer's next process, before later
        messages). Their shared-memory slots that no reader decoded are released
        (:func:`replayrl.transport.shm_pool.release_unread`; docs/design/transport.md#shm-transport).
        """
        unread = self._unread
        while unread and unread[0][0] < number:
            release_unread(unread.popleft()[1])

    def _deliver(self, peer: bytes | None, views: list[memoryview]) -> None:
        self._on_message(views)

    def close(self) -> None:
        """Stop receiving and close the socket (LINGER 0: unsent messages are discarded).
        Idempotent."""
        if self._monitor is not None and not self._closed:
            if self._monitor_fd is not None and self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._monitor_fd)
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._close_socket()
        self._unread.clear()  # unknown from now on: those slots stay busy (module docstring of shm_pool)


def _alone(owned: list[bytes]) -> list[bytes]:
    """A message sent on its own: as it is, unless its one frame starts with the batch marker
    (not a codec header, but a raw payload may), which then travels as a batch of one so that
    the receiver cannot take it for a batch."""
    if len(owned) == 1 and owned[0][:1] == b"\xc1":
        return [pack_batch(owned)]
    return owned


def _coalesce(messages: list[list[bytes]], max_bytes: int) -> Iterator[tuple[list[bytes], list[bytes]]]:
    """``messages`` (each a list of owned frames) as the ZeroMQ messages to send, in order, each
    with the frames whose shared-memory slots it carries: runs of small single-frame messages
    become batch frames (:mod:`replayrl.transport.batch`) of at most ``max_bytes`` and
    :data:`replayrl.transport.batch.MAX_BATCH_MESSAGES` messages; anything else goes alone."""
    run: list[bytes] = []
    size = 0

    def batch() -> tuple[list[bytes], list[bytes]]:
        if len(run) == 1 and run[0][0] != BATCH_MARKER:
            return [run[0]], [run[0]]
        return [pack_batch(run)], run

    for owned in messages:
        frame = owned[0]
        if len(owned) == 1 and 0 < len(frame) < MAX_BATCH_ELEMENT_BYTES:
            if run and (len(run) == MAX_BATCH_MESSAGES
                        or size + len(frame) + batch_overhead(len(run) + 1) > max_bytes):
                yield batch()
                run, size = [], 0
            if batch_overhead(1) + len(frame) <= max_bytes:
                run.append(frame)
                size += len(frame)
                continue
        if run:
            yield batch()
            run, size = [], 0
        yield _alone(owned), owned[:1]
    if run:
        yield batch()


def _private_directory(path: Path) -> None:
    """Make ``path`` (mode 0700, parents as the umask says) or check that it is this user's and
    mode 0700: an ipc socket in a directory others can enter is reachable by other local users.

    Raises:
        TransportError: the directory is another user's, or group / others have any access.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TransportError(
            f"ipc socket directory {path} has mode {stat.S_IMODE(info.st_mode):o} (owner uid "
            f"{info.st_uid}); it must be this user's with mode 700, or other local users could "
            "call the actor")
