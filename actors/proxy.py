"""Typed calls between actors: ``await proxy.method(*args, **kwargs)`` instead of method-name strings.

An :class:`ActorProxy` wraps an :class:`replayrl.actors.ActorRef`. Attribute access names a remote method;
calling it first checks the method and the arguments against the actor's interface
(:mod:`replayrl.actors.interface`, fetched once per connection) and only then sends the call. A misspelt
method or a wrong argument count therefore raises :class:`replayrl.actors.interface.ActorCallError` in
the caller, with the actor's name and the method's signature, and nothing reaches the actor.
The reply timeout belongs to the proxy (:meth:`ActorProxy.with_timeout` makes another), so it
never collides with a remote method's own ``timeout`` argument.
"""
from __future__ import annotations

from typing import Any, Coroutine

from replayrl.actors.envelope import CALL
from replayrl.actors.interface import ActorInterface
from replayrl.actors.ref import ActorRef, Message


class ActorProxy:
    """Typed handle on one actor; cheap to create, safe to copy, used inside an event loop.

    Args:
        ref: the actor's reference (:meth:`replayrl.actors.Directory.ref`).
        timeout: seconds every call (and the one-time interface fetch) waits for its reply;
            ``None`` waits forever.
        shared_memory: whether a call's large arrays may go through this process's
            shared-memory pool to an ipc peer (docs/design/transport.md#shm-transport); False:
            always as ZeroMQ frames.
    """

    __slots__ = ("ref", "timeout", "shared_memory")

    def __init__(self, ref: ActorRef, timeout: float | None = None,
                 shared_memory: bool = True) -> None:
        self.ref = ref
        self.timeout = timeout
        self.shared_memory = shared_memory

    def with_timeout(self, timeout: float | None) -> "ActorProxy":
        """The same actor with another reply timeout (seconds; ``None`` = forever)."""
        return ActorProxy(self.ref, timeout, self.shared_memory)

    def without_shared_memory(self) -> "ActorProxy":
        """The same actor, its calls' arrays sent as ZeroMQ frames even to an ipc peer."""
        return ActorProxy(self.ref, self.timeout, shared_memory=False)

    async def interface(self) -> ActorInterface:
        """The actor's methods and signatures (fetched once per connection)."""
        return await self.ref.interface(self.timeout)

    def __getattr__(self, method: str) -> "RemoteMethod":
        if method.startswith("_"):
            raise AttributeError(f"{method!r}: private and built-in methods are not proxied")
        return RemoteMethod(self, method)

    def __repr__(self) -> str:
        return f"ActorProxy({self.ref.name!r}, timeout={self.timeout})"


class RemoteMethod:
    """One method of one actor; calling it returns an awaitable of the remote result."""

    __slots__ = ("proxy", "method")

    def __init__(self, proxy: ActorProxy, method: str) -> None:
        self.proxy = proxy
        self.method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        """Check the call against the actor's interface, then make it; await the result.

        The arguments are encoded, and their array data copied, now (as
        :meth:`replayrl.actors.ActorRef.call`): a write to an argument after this call, before the
        awaitable ran, does not reach the actor.

        Raises (when awaited):
            replayrl.actors.interface.ActorCallError: no such method, or the arguments do not bind.
            replayrl.actors.RemoteError / replayrl.actors.ActorTimeout: as :meth:`replayrl.actors.ActorRef.call`.
        """
        return self._checked(Message.of(CALL, self.method, args, kwargs, self.proxy.ref.endpoint,
                                        shared_memory=self.proxy.shared_memory), args, kwargs)

    async def _checked(self, message: Message, args: tuple, kwargs: dict) -> Any:
        proxy = self.proxy
        try:
            (await proxy.interface()).check_call(self.method, args, kwargs)
        except BaseException:  # never sent: its shared-memory slots go back now
            message.discard()
            del args, kwargs  # nor may a kept error's traceback hold them (below)
            raise
        # the message owns its bytes: a kept error's traceback must not hold the arguments (a
        # weight push's send buffer would stay held until the cyclic collector ran)
        del args, kwargs
        return await proxy.ref.send(message, proxy.timeout)

    def __repr__(self) -> str:
        return f"<remote method {self.proxy.ref.name}.{self.method}>"
