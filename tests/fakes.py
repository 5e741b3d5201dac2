"""Stand-ins for actor proxies in unit tests of actor-using code."""
from __future__ import annotations


class FakeProxy:
    """An ActorProxy look-alike: ``await proxy.method(...)`` awaits the given coroutine function.

    A method that was not given raises AttributeError, as a misspelt one fails on a real proxy.
    """

    def __init__(self, **methods) -> None:
        self._methods = methods

    def __getattr__(self, method: str):
        try:
            return self.__dict__["_methods"][method]
        except KeyError:
            raise AttributeError(f"fake actor has no method {method!r}") from None
