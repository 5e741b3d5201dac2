"""Typed errors of the transport layer.

Every failure the transport raises is a :class:`TransportError`, so an actor can catch one class,
log the offending message and keep running (docs/design/transport.md#transport-contract).
:class:`NonFiniteJSON` (strict JSON files and lines) is also a ``ValueError``, as ``json`` raises.
"""

from __future__ import annotations

__all__ = ["TransportError", "EncodeError", "DecodeError", "MessageTooLarge", "NonFiniteJSON",
           "TraceCodecError", "PeerUnreachable"]


class TransportError(Exception):
    """Base class of every error raised by ``transport`` (bad endpoints, socket failures, codec)."""


class EncodeError(TransportError):
    """An object cannot be put on the wire: unsupported type, dtype outside the allow-list,
    non-CPU tensor, dict key that is not ``str``/``int``, nesting too deep, or message too large.
    The message names the offending type and, inside a dict, the key path."""


class DecodeError(TransportError):
    """A received message is malformed: bad msgpack in frame 0, unknown ext type, truncated or
    surplus array data, frame index out of range, unreferenced frames, disallowed dtype, bad shape.
    Raised instead of returning anything partial; the receiver can drop the message and go on."""


class MessageTooLarge(DecodeError):
    """A received message (all frames together) or one array in it is larger than the codec's
    ``max_message_bytes``; raised before any array is built."""


class PeerUnreachable(TransportError):
    """A ROUTER's message to a peer that is no longer connected (its socket closed, its process
    gone): nothing can deliver it. For a server this is a reply to a caller that left, e.g. a
    launcher that stopped on SIGTERM with calls in flight; it drops the reply."""


class NonFiniteJSON(TransportError, ValueError):
    """A NaN / infinity where strict JSON has no value (:mod:`replayrl.transport.strict_json`);
    the message names the key path."""


class TraceCodecError(TransportError, ValueError):
    """An encoded trace that is malformed (sizes that disagree, unknown codec, a value outside
    its row's universe); the message names the part (:mod:`replayrl.transport.trace_codec`)."""
