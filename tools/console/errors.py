"""The errors of ``replayrl repl``'s own machinery (the actors' errors are
:mod:`replayrl.actors`'); re-exported by :mod:`replayrl.tools.console.repl`."""
from __future__ import annotations

__all__ = ["ReplError", "SessionClosed"]


class ReplError(RuntimeError):
    """Base class of the REPL's own errors."""


class SessionClosed(ReplError):
    """A call was made on a :class:`replayrl.tools.console.repl.ReplSession` that is not
    started or already stopped."""
