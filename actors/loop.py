"""Run a coroutine on uvloop when it is installed, else on the standard asyncio loop.

docs/design/transport.md#transport-contract records uvloop changing dispatch rates by at most 8 %,
so it is a preference, not a requirement; the launcher, every actor process and the tests all go
through this one function.
"""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine


def run_event_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to completion on a fresh event loop and return its result."""
    try:
        import uvloop
    except ImportError:  # optional on platforms without uvloop wheels
        return asyncio.run(coro)
    return uvloop.run(coro)
