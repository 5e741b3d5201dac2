"""Bounded, rate-limited error reports: a flood of malformed messages must cost the actor
neither its log nor its bandwidth (docs/design/actors.md#actor-contract).

Every error text an actor sends or logs about a peer's message is cut to :data:`MAX_ERROR_TEXT`
characters (:func:`clip`), and the log lines of one kind are limited by a token bucket
(:class:`RateLimitedLog`): a burst of ``burst`` lines, then ``per_second``; the next line that
gets through says how many were suppressed meanwhile.
"""
from __future__ import annotations

import logging
import time

__all__ = ["MAX_ERROR_TEXT", "MAX_TRACEBACK_TEXT", "clip", "RateLimitedLog"]

MAX_ERROR_TEXT = 2000
"""Longest error message an actor sends or logs, characters."""
MAX_TRACEBACK_TEXT = 16000
"""Longest traceback an actor sends, characters (its end is kept: the raising frame)."""


def clip(text: str, limit: int = MAX_ERROR_TEXT, keep_end: bool = False) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was.

    Args:
        keep_end: keep the last ``limit`` characters instead of the first (for tracebacks).
    """
    if len(text) <= limit:
        return text
    note = f" [... {len(text) - limit} of {len(text)} chars cut ...] "
    return note + text[-limit:] if keep_end else text[:limit] + note


class RateLimitedLog:
    """A token bucket in front of ``logger.log``: at most ``burst`` lines at once, refilled at
    ``per_second`` lines per second; suppressed lines are counted and reported by the next one.

    Args:
        logger: where lines go.
        per_second: sustained lines per second (> 0).
        burst: bucket size, lines (>= 1).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, logger: logging.Logger, per_second: float = 1.0, burst: int = 10,
                 clock=time.monotonic) -> None:
        self.logger, self.per_second, self.burst, self.clock = logger, per_second, burst, clock
        self.tokens = float(burst)
        self.last = clock()
        self.suppressed = 0

    def log(self, level: int, message: str) -> bool:
        """Log ``message`` (clipped) at ``level`` if the bucket has a token; returns whether it
        was logged."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.per_second)
        self.last = now
        if self.tokens < 1:
            self.suppressed += 1
            return False
        self.tokens -= 1
        if self.suppressed:
            message = f"{message} ({self.suppressed} similar lines suppressed)"
            self.suppressed = 0
        self.logger.log(level, clip(message))
        return True
