"""Typed errors of the tools layer: the run, the console and the benchmarks (docs/design/errors.md#errors).

Every error the tools raise derives from :class:`ToolsError`, except :class:`Terminated`, a
``KeyboardInterrupt`` on purpose (SIGTERM must unwind like Ctrl-C, past every ``except
Exception``). What a caller catches:

- a run refused before it starts (a ``ValueError``): :class:`ConfigError` (exit code 2), and
  :class:`MetricKeyError`, :class:`BenchError` for the console's and the benchmarks' settings;
- a run that failed while it ran (a ``RuntimeError``): :class:`RunFailed`,
  :class:`RendezvousError`, :class:`MetricsHookError`, :class:`AttachError`,
  :class:`ReplError` (:class:`SessionClosed`), :class:`PeerBenchError`, :class:`PriorityError`.
"""
from __future__ import annotations

__all__ = [
    "ToolsError", "ConfigError", "MetricKeyError", "BenchError", "RunFailed", "RendezvousError",
    "MetricsHookError", "AttachError", "ReplError", "SessionClosed", "PeerBenchError",
    "PriorityError", "Terminated",
]


class ToolsError(Exception):
    """Base class of every tools-layer error (but :class:`Terminated`)."""


# --- refused before the run starts ----------------------------------------------------------------

class ConfigError(ToolsError, ValueError):
    """An unknown key, a bad value, or an unsupported combination (names the flags)."""


class MetricKeyError(ToolsError, ValueError):
    """``metrics(keys=...)`` named a key no shown row has (a typo, not a failure: the console
    prints it as one line)."""


class BenchError(ToolsError, ValueError):
    """A benchmark setting that cannot run (sizes, top-k larger than the vocabulary, ...)."""


# --- failed while it ran ------------------------------------------------------------------------

class RunFailed(ToolsError, RuntimeError):
    """The driver stopped this rank because the run failed (its reason in the message)."""


class SFTError(ToolsError, RuntimeError):
    """A ``replayrl sft`` step that cannot train (a gradient norm that is not finite), naming the step."""


class RendezvousError(ToolsError, RuntimeError):
    """The ranks could not exchange their addresses (names the rank and the master)."""


class MetricsHookError(ToolsError, RuntimeError):
    """A ``--metrics-hook`` raised; the message names the hook and the step and carries its
    traceback (the run ends: a logger that fails would otherwise lose rows silently)."""


class AttachError(ToolsError, RuntimeError):
    """The attach target is no running run (the message names the path or address and why)."""


class ReplError(ToolsError, RuntimeError):
    """Base class of the REPL's own errors."""


class SessionClosed(ReplError):
    """A call was made on a :class:`replayrl.tools.console.repl.ReplSession` that is not started
    or already stopped."""


class PeerBenchError(ToolsError, RuntimeError):
    """The peer benchmark cannot run or its two sides did not see the same inputs."""


class PriorityError(ToolsError, RuntimeError):
    """The autogroup nice value could not be read or set (no autogroup support, not root)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM handled like Ctrl-C: the same unwinding stops every actor, then exit 143.

    Deliberately no :class:`ToolsError` (an ``Exception``): ``except Exception`` must not stop it.
    """
