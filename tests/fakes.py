"""Stand-ins for actor refs in unit tests of actor-using code."""
from __future__ import annotations


class FakeRef:
    """An ActorRef look-alike whose ``call(method, ...)`` awaits the given coroutine function."""

    def __init__(self, **methods) -> None:
        self.methods = methods

    async def call(self, method: str, *args, timeout: float | None = None, **kwargs):
        return await self.methods[method](*args, **kwargs)
