"""Errors raised by the actor runtime.

Every error an actor call can raise on the caller's side derives from :class:`ActorError`, so a
driver can tell "the remote method failed" (:class:`RemoteError`) from "the actor is gone"
(:class:`ActorDied`) from "no answer in time" (:class:`ActorTimeout`). What a caller catches:

- the call cannot be made: :class:`ActorCallError` (a ``TypeError``: no such method, bad
  arguments), :class:`UnknownActor` (a ``KeyError``: no such name in the directory),
  :class:`ProtocolError` (a malformed message);
- the remote side failed: :class:`RemoteError` (the method raised), :class:`ActorDied`,
  :class:`PeerLost`, :class:`ActorTimeout` (a ``TimeoutError``);
- a version-clock rule was broken: :class:`VersionError` (a ``ValueError``) and its two kinds;
- a process's device cannot be had: :class:`DeviceError` (a ``ValueError``;
  :mod:`replayrl.actors.device`).
"""
from __future__ import annotations


class ActorError(Exception):
    """Base class of every actor-runtime error."""


class RemoteError(ActorError):
    """A remote method raised; carries the remote exception's type name, message and traceback.

    Attributes:
        actor: name of the actor whose method raised.
        method: the method that was called.
        remote_type: ``type(exc).__qualname__`` on the remote side (e.g. ``"ValueError"``).
        remote_message: ``str(exc)`` on the remote side.
        remote_traceback: the formatted traceback text from the remote process.
    """

    def __init__(self, actor: str, method: str, remote_type: str, remote_message: str,
                 remote_traceback: str) -> None:
        self.actor = actor
        self.method = method
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        super().__init__(f"{actor}.{method} raised {remote_type}: {remote_message}\n"
                         f"--- remote traceback ({actor}) ---\n{remote_traceback}")

    def __reduce__(self):  # keeps the error picklable for multiprocessing / pytest reports
        return (RemoteError, (self.actor, self.method, self.remote_type, self.remote_message,
                              self.remote_traceback))


class ActorTimeout(ActorError, TimeoutError):
    """No reply to ``ActorRef.call`` within its ``timeout`` (seconds)."""


class ActorDied(ActorError):
    """An actor process exited unexpectedly; ``traceback_text`` is what it reported, if anything.
    ``exitcode`` None: an actor the launcher serves in its own process
    (:class:`replayrl.actors.DriverActors`) stopped before the run ended.

    ``members``: every actor that shared the process (``ActorSpec.process``,
    docs/design/actors.md#colocate), all lost with it; empty for a process of one actor. The message
    names them all. ``note``: what the loss means to the run (for example which checkpoint to
    resume from), appended to the message's first line; empty for none.
    """

    def __init__(self, actor: str, exitcode: int | None, traceback_text: str = "",
                 members: tuple[str, ...] = (), note: str = "") -> None:
        self.actor = actor
        self.exitcode = exitcode
        self.traceback_text = traceback_text
        self.members = tuple(members)
        self.note = note
        who = (f"actors {', '.join(map(repr, self.members))} (one process)" if len(self.members) > 1
               else f"actor {actor!r}")
        detail = f"\n--- traceback ({actor}) ---\n{traceback_text}" if traceback_text else ""
        # None: an actor served in the launcher's own process (DriverActors) stopped early
        ended = "stopped serving" if exitcode is None else f"exited with code {exitcode}"
        super().__init__(f"{who} {ended}{'; ' + note if note else ''}{detail}")

    def __reduce__(self):
        return (ActorDied, (self.actor, self.exitcode, self.traceback_text, self.members, self.note))


class PeerLost(ActorError):
    """The connection to the actor was lost (its process died, stopped answering heartbeats, or
    refused our keys) while a call waited for its reply: the reply will never come."""


class ProtocolError(ActorError):
    """A message reached an actor but is not a valid call (bad envelope, unknown method, ...)."""


class ActorCallError(ActorError, TypeError):
    """A call names no method of the actor, or its arguments do not fit the method's signature.

    Raised in the caller's process before anything is sent; the message names the actor, the
    method and the signature.
    """


class UnknownActor(ActorError, KeyError):
    """No actor of that name is in the directory."""


class VersionError(ActorError, ValueError):
    """Base class of version-clock rule violations."""


class VersionRegression(VersionError):
    """A trainer or engine version moved backwards."""


class StaleSample(VersionError):
    """A sample's policy version is outside ``[t - max_staleness, t]``."""


class DeviceError(ActorError, ValueError):
    """``--device`` names a device this machine or process does not have (``cuda`` without
    CUDA, no visible device), or a malformed ``LOCAL_RANK``."""
