"""Server side of the actor runtime: the :class:`Actor` base class and :class:`ActorServer`.

An actor is an object whose public ``async def`` methods can be called over ZeroMQ. Calls are
executed one at a time in arrival order (so an actor's state needs no locks), except methods
decorated with :func:`concurrent`, which run as their own task as soon as they arrive. A
malformed message, an unknown method or a method that raises is answered with an error reply;
the actor keeps serving.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import os
import traceback
from typing import TYPE_CHECKING, Any, Callable

import msgpack

from replayrl.actors.envelope import CALL, err_reply, ok_reply, parse_request
from replayrl.actors.errors import ProtocolError
from replayrl.actors.interface import RUNTIME_NAMES, describe
from replayrl.actors.log_limit import RateLimitedLog, clip
from replayrl.actors.proxy import ActorProxy
from replayrl.actors.ref import shared_memory_pool, shared_memory_reader
from replayrl.transport import Codec, RouterSocket
from replayrl.transport.curve import CurveKeys
from replayrl.transport.endpoints import shares_memory
from replayrl.transport.errors import PeerUnreachable

if TYPE_CHECKING:
    from replayrl.actors.directory import Directory
    from replayrl.actors.ref import ActorRef

log = logging.getLogger(__name__)
_CONCURRENT = "_replayrl_concurrent"
# answered at once, outside the call order
_BUILTINS = ("__ping__", "__stop__", "__interface__", "__directory__")

DEFAULT_MAX_PENDING = 4096
"""Calls an actor holds (queued or running) before it refuses new ones with ``Overloaded``: a
flood of requests costs bounded memory; a caller's own in-flight limit (``replayrl.actors.ref``) keeps a
well-behaved caller below it."""


def concurrent(method: Callable) -> Callable:
    """Mark an actor method to run as its own task instead of in arrival order.

    Use it for methods that only wait (e.g. a method that awaits other actors) so they do not
    block the actor's queue; they must not mutate state that ordered methods rely on.
    """
    setattr(method, _CONCURRENT, True)
    return method


class Actor:
    """Base class of actors. Subclasses define ``async def`` public methods.

    The runtime sets ``self.name`` and ``self.directory`` before :meth:`on_start` runs.
    Built-in remote methods: ``__ping__`` (liveness; returns ``{"name", "pid"}``), ``__stop__``
    (optional argument: why the run failed, which :func:`replayrl.actors.serve.serve_actor` returns),
    ``__interface__`` (the class's public methods, signatures and docstrings,
    :mod:`replayrl.actors.interface`, which typed proxies check calls against) and ``__directory__``
    (the run's endpoints, ``{name: endpoint}``, so a console given one actor's address finds
    the others: docs/design/multi-host.md#attach-and-multi-host).
    """

    name: str = ""
    directory: "Directory | None" = None

    async def on_start(self) -> None:
        """Called once in the actor's process before it serves any call."""

    async def on_stop(self) -> None:
        """Called once when the actor stops (after ``__stop__`` or on parent exit)."""

    def ref(self, name: str) -> "ActorRef":
        """A reference to another actor of this run, looked up in the directory.

        Raises:
            replayrl.actors.directory.UnknownActor: no actor of that name in the directory.
        """
        if self.directory is None:
            raise RuntimeError(f"actor {self.name!r} has no directory")
        return self.directory.ref(name)

    def proxy(self, name: str, timeout: float | None = None) -> "ActorProxy":
        """A typed proxy to another actor of this run (``timeout`` in seconds, ``None`` = forever).

        Raises:
            replayrl.actors.directory.UnknownActor: no actor of that name in the directory.
        """
        return ActorProxy(self.ref(name), timeout)


class ActorServer:
    """Serves one :class:`Actor` on a ZeroMQ ROUTER socket at ``endpoint``.

    Args:
        actor: the actor.
        endpoint: where to listen (``tcp://`` needs ``curve``).
        codec: message codec and limits (default :class:`replayrl.transport.Codec`).
        curve: the run's CURVE keys (:mod:`replayrl.transport.curve`).
        max_pending: calls held at once, queued or running; more are refused with an
            ``Overloaded`` error reply (builtins are always answered).
    """

    def __init__(self, actor: Actor, endpoint: str, codec: Codec | None = None,
                 curve: CurveKeys | None = None, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.actor = actor
        self.endpoint = endpoint
        self.codec = codec or Codec()
        self.max_pending = max_pending
        # an ipc peer is on this node: large arrays both ways go through shared memory
        # (docs/design/transport.md#shm-transport)
        self._local = shares_memory(endpoint)
        self.stopped = asyncio.Event()
        self.failure = ""  # set by __stop__(failure): the run this actor served failed
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._router = RouterSocket(endpoint, self._on_message, curve=curve,
                                    max_message_bytes=self.codec.config.max_message_bytes,
                                    on_bad_batch=self._on_bad_batch,
                                    on_unreachable=self._caller_left)
        self._worker: asyncio.Task | None = None
        self._log = RateLimitedLog(log)
        # looked up once, not per call (a class is not changed while it serves)
        cls = type(actor)
        self._concurrent = frozenset(n for n in dir(cls) if getattr(getattr(cls, n, None), _CONCURRENT, False))
        self._methods: dict[str, Callable[..., Any]] = {}  # resolved names only: bounded

    def start(self) -> None:
        """Bind the socket and start the in-order worker (call inside the running loop)."""
        self._router.bind()
        self._worker = asyncio.get_running_loop().create_task(self._run_in_order())

    def close(self) -> None:
        """Stop serving: cancel pending work and close the socket (removes an ipc file)."""
        if self._worker is not None:
            self._worker.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._router.close()

    # -- receiving -------------------------------------------------------------------------
    def _on_message(self, peer: bytes, frames: list) -> None:
        try:
            kind, call_id, method, args, kwargs = parse_request(self.codec.decode(
                frames, shared_memory_reader() if self._local else None))
        except Exception as exc:  # malformed message: answer if we can, keep serving
            self._log.log(logging.ERROR, f"{self.actor.name}: rejected malformed message: "
                                         f"{type(exc).__name__}: {clip(str(exc))}")
            call_id = _best_effort_id(frames)
            if call_id is not None:
                self._send(peer, err_reply(call_id, type(exc).__name__, str(exc), ""))
            return
        item = (peer, kind, call_id, method, args, kwargs)
        if method not in _BUILTINS and self._queue.qsize() + len(self._tasks) >= self.max_pending:
            self._log.log(logging.WARNING, f"{self.actor.name}: overloaded, refusing {clip(method, 100)}")
            if kind == CALL:
                self._send(peer, err_reply(call_id, "Overloaded", f"actor {self.actor.name!r} holds "
                                           f"{self.max_pending} calls; retry later", ""))
            return
        if method in _BUILTINS or method in self._concurrent:
            task = asyncio.get_running_loop().create_task(self._invoke(*item))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._queue.put_nowait(item)

    def _on_bad_batch(self, peer: bytes, exc: Exception) -> None:
        # refused whole by the socket; no call id can be trusted, so nothing is answered
        self._log.log(logging.ERROR, f"{self.actor.name}: rejected malformed batch: {clip(str(exc))}")

    def _caller_left(self, peer: bytes | None, exc: PeerUnreachable) -> None:
        # the caller closed its connection (a launcher stopping with calls in flight): nobody
        # waits for this reply, so its loss is no error
        log.info("%s: reply to a caller that left dropped: %s", self.actor.name, clip(str(exc)))

    async def _run_in_order(self) -> None:
        # until close(): a call that turns close()'s cancel into an error of its own (a call it
        # awaited failed first) returns here, and the loop must not wait for more
        while not self._router.closed:
            item = await self._queue.get()
            await self._invoke(*item)
            # not held while waiting for the next call: a shared-memory argument's slot goes
            # back to its sender now (docs/design/transport.md#shm-transport)
            del item

    # -- executing -------------------------------------------------------------------------
    def _resolve(self, method: str) -> Callable[..., Any]:
        fn = self._methods.get(method)
        if fn is None:  # an unknown name raises and is not remembered
            fn = self._methods[method] = self._lookup(method)
        return fn

    def _lookup(self, method: str) -> Callable[..., Any]:
        if method == "__ping__":
            return self._ping
        if method == "__stop__":
            return self._stop
        if method == "__interface__":
            return self._interface
        if method == "__directory__":
            return self._directory
        fn = getattr(type(self.actor), method, None)
        # Nothing the Actor base class defines (lifecycle hooks, ref / proxy, name, directory)
        # is a remote method, whatever a subclass overrides: the runtime calls those.
        if (method.startswith("_") or method in RUNTIME_NAMES
                or fn is None or not inspect.iscoroutinefunction(fn)):
            raise ProtocolError(f"actor {self.actor.name!r} ({type(self.actor).__name__}) "
                                f"has no public async method {clip(method, 100)!r}")
        return getattr(self.actor, method)

    async def _invoke(self, peer: bytes, kind: str, call_id: int, method: str,
                      args: list, kwargs: dict) -> None:
        try:
            result = await self._resolve(method)(*args, **kwargs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            tb = traceback.format_exc()
            if kind != CALL:
                self._log.log(logging.ERROR, f"{self.actor.name}.{clip(method, 100)} (tell) raised:\n"
                                             f"{clip(tb, keep_end=True)}")
                return
            self._send(peer, err_reply(call_id, type(exc).__qualname__, str(exc), tb))
            return
        if kind == CALL:
            self._send(peer, ok_reply(call_id, result))

    def _send(self, peer: bytes, reply: dict) -> None:
        try:
            frames = self.codec.encode(reply, shared_memory_pool() if self._local else None)
        except Exception as exc:  # the result itself cannot travel: tell the caller why
            frames = self.codec.encode(err_reply(reply["id"], type(exc).__qualname__, str(exc),
                                                 traceback.format_exc()))
        if self._router.closed:
            # this actor is stopping (its socket closed under a call that was still running, e.g.
            # one whose own call failed when the run ended): nobody can be answered any more
            log.info("%s: reply dropped: the actor is stopping", self.actor.name)
            return
        try:
            self._router.send(peer, frames)
        except PeerUnreachable as exc:
            self._caller_left(peer, exc)

    async def _ping(self) -> dict:
        return {"name": self.actor.name, "pid": os.getpid()}

    async def _interface(self) -> dict:
        return describe(type(self.actor))

    async def _directory(self) -> dict:
        # endpoints only: where the run's CURVE keys lie is the caller's own business
        directory = self.actor.directory
        return directory.to_dict() if directory is not None else {self.actor.name: self.endpoint}

    async def _stop(self, failure: str = "") -> bool:
        self.failure = str(failure)
        self.stopped.set()
        return True


def _best_effort_id(frames: list) -> int | None:
    """The call id of a message that failed validation, if its envelope can still be read.

    Reads only the top-level map's ``"k"`` and ``"id"`` (every other value is skipped, never
    built, and small limits hold for what is built), so a header the codec refused for its size
    or its decoding cost is not decoded in full here.
    """
    try:
        head = frames[0]
        head = head.buffer if hasattr(head, "buffer") else head
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(1, len(head)),
                                    max_array_len=16, max_map_len=16, max_str_len=64,
                                    max_bin_len=64, max_ext_len=64)
        unpacker.feed(head)
        fields = {}
        for _ in range(min(unpacker.read_map_header(), 16)):
            key = unpacker.unpack()
            if key in ("k", "id"):
                fields[key] = unpacker.unpack()
            else:
                unpacker.skip()
        call_id = fields.get("id")
        return call_id if type(call_id) is int and fields.get("k") == CALL else None
    except Exception:
        return None
