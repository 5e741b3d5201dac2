"""Client side of the actor runtime: :class:`ActorRef` and the per-process connection pool.

One ZeroMQ DEALER socket per peer endpoint per process (docs/design/transport.md#transport-contract:
one socket per peer, not per request); every ``ActorRef`` to the same endpoint shares it, and
replies are matched to calls by id.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Coroutine

import numpy as np

from replayrl.actors.envelope import CALL, ERR, OK, TELL, request
from replayrl.actors.errors import ActorTimeout, PeerLost, ProtocolError, RemoteError
from replayrl.actors.interface import ActorInterface
from replayrl.actors.log_limit import RateLimitedLog, clip
from replayrl.transport import Codec, DealerSocket, owned_frames
from replayrl.transport.curve import CurveKeys
from replayrl.transport.endpoints import shares_memory
from replayrl.transport.shm_pool import (
    DEFAULT_SHM_MIN_ARRAY_BYTES,
    DEFAULT_SHM_POOL_BYTES,
    ShmHeader,
    ShmPool,
    ShmReader,
)
from replayrl.transport.sockets import DEFAULT_HEARTBEAT_MS

log = logging.getLogger(__name__)
_CALL_IDS = itertools.count(1)

DEFAULT_MAX_IN_FLIGHT = 1024
"""Calls one process has in flight to one actor; further calls wait for a slot before they are
sent (backpressure: a caller that starts 10,000 calls never has more than this many queued at
the peer, below its ``replayrl.actors.actor.DEFAULT_MAX_PENDING``)."""


class _Connection:
    """One DEALER socket to one actor endpoint, bound to the event loop that created it.

    A lost connection (peer process gone, heartbeat timeout, keys refused) fails every call
    waiting on it with :class:`PeerLost`: no call waits forever for a peer known to be dead.
    """

    def __init__(self, endpoint: str, codec: Codec, curve: CurveKeys | None,
                 max_in_flight: int, heartbeat_ms: tuple[int, int], shm: ShmReader | None) -> None:
        self.endpoint = endpoint
        self.codec = codec
        self.shm = shm  # the process's reader for an ipc peer's shared-memory arrays
        self.pending: dict[int, tuple[asyncio.Future, str, str]] = {}
        self.numbers: dict[int, int] = {}  # call id -> the request's number on the socket
        self.interface: asyncio.Future | None = None  # the peer's ActorInterface, fetched once
        self.slots = asyncio.Semaphore(max_in_flight)
        self._log = RateLimitedLog(log)
        self.socket = DealerSocket(endpoint, self._on_message, curve=curve,
                                   max_message_bytes=codec.config.max_message_bytes,
                                   on_disconnect=self._on_disconnect, heartbeat_ms=heartbeat_ms,
                                   on_bad_batch=self._on_bad_batch)
        self.socket.connect()

    def _on_disconnect(self, reason: str) -> None:
        pending, self.pending = self.pending, {}
        for future, actor, method in pending.values():
            if not future.done():
                future.set_exception(PeerLost(f"{actor}.{method}: {reason}"))
        if self.interface is not None and self.interface.done():
            self.interface = None  # a restarted peer may be another class

    def _on_bad_batch(self, peer: None, exc: Exception) -> None:
        self._log.log(logging.ERROR, f"dropping malformed batch of replies from {self.endpoint}: {clip(str(exc))}")

    def _on_message(self, frames: list) -> None:
        try:
            reply = self.codec.decode(frames, self.shm)
            call_id, kind = reply["id"], reply["k"]
        except Exception as exc:  # a malformed reply must not kill the caller's loop
            self._log.log(logging.ERROR, f"dropping malformed reply from {self.endpoint}: "
                                         f"{type(exc).__name__}: {clip(str(exc))}")
            return
        number = self.numbers.get(call_id) if type(call_id) is int else None
        if number is not None:  # the peer read the request: earlier unread slots are free
            self.socket.peer_read(number)
        entry = self.pending.pop(call_id, None)
        if entry is None:  # late reply to a call that already timed out
            return
        future, actor, method = entry
        if future.done():
            return
        if kind == OK:
            future.set_result(reply.get("v"))
        elif kind == ERR:
            future.set_exception(RemoteError(actor, method, str(reply.get("t")),
                                             str(reply.get("msg")), str(reply.get("tb"))))
        else:
            future.set_exception(ProtocolError(f"reply from {actor} has unknown kind {kind!r}"))

    def close(self) -> None:
        for future, actor, method in self.pending.values():
            if not future.done():
                future.set_exception(ProtocolError(f"connection to {actor} closed during {method}"))
        self.pending.clear()
        self.socket.close()


class _Pool:
    """The connections of the current process, one per (event loop, endpoint)."""

    def __init__(self) -> None:
        self.codec = Codec()
        self.connections: dict[tuple[int, str], _Connection] = {}
        self.curve: CurveKeys | None = None  # the run's keys, for tcp peers (use_curve_keys)
        self.max_in_flight = DEFAULT_MAX_IN_FLIGHT
        self.heartbeat_ms = DEFAULT_HEARTBEAT_MS
        # large arrays to and from ipc peers (docs/design/transport.md#shm-transport); slots are made on first use
        self.shm: ShmPool | None = ShmPool(DEFAULT_SHM_POOL_BYTES, DEFAULT_SHM_MIN_ARRAY_BYTES)
        self.shm_reader = ShmReader()

    def get(self, endpoint: str) -> _Connection:
        key = (id(asyncio.get_running_loop()), endpoint)
        conn = self.connections.get(key)
        if conn is None:
            conn = self.connections[key] = _Connection(
                endpoint, self.codec, self.curve, self.max_in_flight, self.heartbeat_ms,
                self.shm_reader if shares_memory(endpoint) else None)
        return conn

    def pool_for(self, endpoint: str) -> ShmPool | None:
        """The shared-memory pool for messages to ``endpoint``: only an ipc peer gets one."""
        return self.shm if shares_memory(endpoint) else None

    def close_all(self) -> None:
        for conn in self.connections.values():
            conn.close()
        self.connections.clear()

    def close_loop(self, loop_id: int) -> None:
        """Close the connections of the event loop ``loop_id`` only (other threads' loops keep
        theirs)."""
        for key in [k for k in list(self.connections) if k[0] == loop_id]:
            self.connections.pop(key).close()


POOL = _Pool()


@dataclass(frozen=True)
class Message:
    """A request encoded when it was made: its frames are bytes the sender owns, so no later
    write to the caller's arrays changes it (``transport.owned_frames``).

    Attributes:
        call_id: the request's id (replies are matched by it).
        method: the remote method's name.
        frames: the encoded request; empty when encoding failed.
        error: the encoding error (e.g. ``replayrl.transport.EncodeError``), raised when the message
            would be sent; ``None`` otherwise.
    """

    call_id: int
    method: str
    frames: tuple[bytes, ...]
    error: Exception | None = None

    def discard(self) -> None:
        """Release now the shared-memory slots of a message that will not be sent (its call
        failed or was cancelled first): an exception's traceback may keep the message alive
        until the cyclic garbage collector runs (``ShmHeader.discard``). Not for a message
        that was given to a socket."""
        for frame in self.frames[:1]:
            if type(frame) is ShmHeader:
                frame.discard()

    @classmethod
    def of(cls, kind: str, method: str, args: tuple, kwargs: dict, endpoint: str = "",
           shared_memory: bool = True) -> "Message":
        """Encode ``method(*args, **kwargs)`` for the actor at ``endpoint`` now and copy its array
        data: large arrays into this process's shared-memory pool for an ipc peer (unless
        ``shared_memory`` is False), everything else into bytes the message owns
        (docs/design/transport.md#shm-transport)."""
        call_id = next(_CALL_IDS)
        pool = POOL.pool_for(endpoint) if shared_memory else None
        try:
            frames = owned_frames(POOL.codec.encode(request(kind, call_id, method, args, kwargs),
                                                    pool))
        except Exception as exc:  # raised where the message is sent, as an unencodable call was
            return cls(call_id, method, (), exc)
        return cls(call_id, method, tuple(frames))


def close_connections(this_loop_only: bool = False) -> None:
    """Close every client socket of this process (call before the event loop ends); with
    ``this_loop_only``, only those of the running event loop, for a process whose actors serve
    on event loops of their own threads (``ActorSpec.thread``, docs/design/actors.md#colocate)."""
    if this_loop_only:
        POOL.close_loop(id(asyncio.get_running_loop()))
    else:
        POOL.close_all()


def heartbeat_ms(deadline_s: float) -> tuple[int, int]:
    """ZMTP heartbeat ``(interval, timeout)`` in milliseconds for a liveness deadline of
    ``deadline_s`` seconds: the connection is dropped after ``deadline_s`` without traffic from
    the peer, with a PING every quarter of it (at most every 2 s), so a few lost PINGs alone
    never cross the deadline.

    Raises:
        ValueError: ``deadline_s`` is not a finite number > 0 (or under 1 ms).
    """
    if not isinstance(deadline_s, (int, float)) or not 0.001 <= deadline_s < float("inf"):
        raise ValueError(f"heartbeat deadline must be a number of seconds >= 0.001, got {deadline_s!r}")
    timeout = int(round(deadline_s * 1000))
    return max(1, min(DEFAULT_HEARTBEAT_MS[0], timeout // 4)), timeout


def use_heartbeat_deadline(deadline_s: float) -> None:
    """Connections this process opens from now on drop a peer silent for ``deadline_s``
    seconds, failing its calls with :class:`PeerLost` (:func:`heartbeat_ms`); one run per
    process (:class:`replayrl.actors.Directory` carries the run's deadline)."""
    POOL.heartbeat_ms = heartbeat_ms(deadline_s)


def connection_lost(endpoint: str) -> str | None:
    """Why this process's connection to ``endpoint`` is down (process gone, heartbeats
    unanswered past the deadline, keys refused), or None while it is up or was never opened
    (must run inside the event loop whose connections are meant)."""
    conn = POOL.connections.get((id(asyncio.get_running_loop()), endpoint))
    return conn.socket.lost if conn is not None else None
def use_shared_memory(max_bytes: int, min_array_bytes: int) -> None:
    """How this process sends large arrays to ipc peers from now on: through a pool of at most
    ``max_bytes`` of shared memory (0: never; as ZeroMQ frames), for arrays of at least
    ``min_array_bytes`` (docs/design/transport.md#shm-transport).

    Raises:
        replayrl.transport.TransportError: a negative size or ``min_array_bytes`` < 1.
    """
    pool = ShmPool(max_bytes, min_array_bytes)  # checks the values before anything changes
    old, POOL.shm = POOL.shm, (pool if max_bytes > 0 else None)
    if old is not None:
        old.close()  # messages already sent keep their slots: receivers map them on their own


def shared_memory_pool() -> ShmPool | None:
    """This process's shared-memory pool for ipc peers (None when switched off)."""
    return POOL.shm


def send_buffer(size: int, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """A writable 1-D array of ``size`` elements of ``dtype`` to fill and then send to ipc peers:
    in a slot of this process's shared-memory pool when it has room, so that the first call
    carrying the whole array copies nothing (:meth:`replayrl.transport.shm_pool.ShmPool.buffer`);
    else an ordinary ``np.empty``. Contents are not initialised.

    Raises:
        ValueError: ``size`` < 0.
    """
    dtype = np.dtype(dtype)
    if size < 0:
        raise ValueError(f"send_buffer size must be >= 0, got {size}")
    pool = POOL.shm
    flat = pool.buffer(size * dtype.itemsize) if pool is not None else None
    return np.empty(size, dtype) if flat is None else flat.view(dtype)


def shared_memory_reader() -> ShmReader:
    """This process's reader of ipc peers' shared-memory arrays."""
    return POOL.shm_reader


def use_curve_keys(keys: CurveKeys | None) -> None:
    """The CURVE keys this process's connections to ``tcp://`` actors use from now on (one run
    per process; :class:`replayrl.actors.Directory` carries where they are)."""
    POOL.curve = keys


class ActorRef:
    """A handle to a named actor at a ZeroMQ endpoint; cheap to create, safe to copy.

    Must be used from inside a running event loop. Calls to one actor are executed in arrival
    order unless the remote method is marked :func:`actors.concurrent`.
    """

    __slots__ = ("name", "endpoint")

    def __init__(self, name: str, endpoint: str) -> None:
        self.name = name
        self.endpoint = endpoint

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r}, {self.endpoint!r})"

    def call(self, method: str, *args: Any, timeout: float | None = None,
             **kwargs: Any) -> Coroutine[Any, Any, Any]:
        """Call ``method(*args, **kwargs)`` on the actor; await the result for its return value.

        The arguments are encoded, and their array data copied, when ``call`` is invoked, not
        when the returned awaitable first runs: ``asyncio.ensure_future(ref.call("m", arr))``
        followed by a write to ``arr`` sends the array as it was at the call.

        Args:
            timeout: seconds to wait for the reply; ``None``: no deadline, but the call still
                fails once the connection is known lost.
        Raises (when awaited):
            RemoteError: the remote method raised (remote type, message and traceback attached);
                ``remote_type == "Overloaded"`` when the actor held too many calls.
            ActorTimeout: no reply within ``timeout`` seconds; a late reply is discarded.
            PeerLost: the connection was lost (process gone, heartbeats unanswered, keys
                refused) before the reply came.
            replayrl.transport.EncodeError: an argument cannot be encoded (nothing was sent).
        """
        return self.send(Message.of(CALL, method, args, kwargs, self.endpoint), timeout)

    async def send(self, message: Message, timeout: float | None = None) -> Any:
        """Send a :class:`Message` made by :meth:`Message.of` with ``CALL`` and await its reply
        (as :meth:`call`; used by :class:`replayrl.actors.ActorProxy`, which checks the call first)."""
        if message.error is not None:
            raise message.error
        conn = POOL.get(self.endpoint)
        call_id, method = message.call_id, message.method
        try:
            await conn.slots.acquire()  # backpressure: at most max_in_flight calls at the peer
            if conn.socket.lost is not None:  # would wait for a reply no process will send
                conn.slots.release()
                raise PeerLost(f"{self.name}.{method}: {conn.socket.lost}")
        except BaseException:  # never sent (lost peer, cancelled): its slots go back now
            message.discard()
            raise
        try:
            future = asyncio.get_running_loop().create_future()
            conn.pending[call_id] = (future, self.name, method)
            try:
                conn.numbers[call_id] = conn.socket.send(list(message.frames))
            except BaseException:
                conn.pending.pop(call_id, None)
                message.discard()
                raise
            try:
                if timeout is None:
                    return await future
                return await asyncio.wait_for(future, timeout)
            except asyncio.TimeoutError:
                raise ActorTimeout(f"{self.name}.{method} gave no reply within {timeout} s") from None
            finally:
                conn.pending.pop(call_id, None)
                conn.numbers.pop(call_id, None)
        finally:
            conn.slots.release()

    async def reachable(self, timeout: float) -> None:
        """Return once the actor answers ``__ping__`` from this process.

        A call on a connection known lost fails at once (:meth:`send`); after the peer's
        process was replaced, each process's connection comes back on its own schedule
        (ZeroMQ reconnects), so a caller that learned of the replacement elsewhere waits here
        before its first call.

        Raises:
            ActorTimeout: no answer within ``timeout`` seconds.
        """
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                await self.call("__ping__", timeout=max(0.01, min(1.0, left)))
                return
            except (PeerLost, ActorTimeout):
                if left <= 0:
                    raise ActorTimeout(f"{self.name} not reachable within {timeout} s") from None
                await asyncio.sleep(0.05)

    async def interface(self, timeout: float | None = None) -> ActorInterface:
        """The actor's methods and signatures (its ``__interface__``), fetched once per connection.

        Raises:
            ActorTimeout / RemoteError / ProtocolError: as :meth:`call`; a failed fetch is not
                cached, so the next call asks again.
        """
        conn = POOL.get(self.endpoint)
        fetch = conn.interface
        if fetch is None or (fetch.done() and (fetch.cancelled() or fetch.exception() is not None)):
            fetch = conn.interface = asyncio.ensure_future(self._fetch_interface(timeout))
        return await asyncio.shield(fetch)  # a cancelled caller leaves the shared fetch running

    async def _fetch_interface(self, timeout: float | None) -> ActorInterface:
        return ActorInterface.from_description(self.name, await self.call("__interface__",
                                                                          timeout=timeout))

    def tell(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Fire-and-forget ``method(*args, **kwargs)``: no reply, remote errors are only logged.

        The message is complete when this returns (its array data copied by the transport), so
        the caller may write to its arrays at once.

        Raises:
            replayrl.transport.EncodeError: an argument cannot be encoded (nothing was sent).
        """
        conn = POOL.get(self.endpoint)
        conn.socket.send(conn.codec.encode(request(TELL, next(_CALL_IDS), method, args, kwargs),
                                           POOL.pool_for(self.endpoint)))
