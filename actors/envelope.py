"""The call / reply envelope that actors exchange (one msgpack object per ZeroMQ message).

Request:  ``{"k": "call" | "tell", "id": int, "m": method, "a": [args], "kw": {kwargs}}``
Reply:    ``{"k": "ok", "id": int, "v": value}`` or
          ``{"k": "err", "id": int, "t": type name, "msg": str, "tb": traceback text}``

Arrays inside ``a``, ``kw`` and ``v`` travel as the transport codec's out-of-band frames.
"""
from __future__ import annotations

from typing import Any

from replayrl.actors.errors import ProtocolError
from replayrl.actors.log_limit import MAX_TRACEBACK_TEXT, clip

CALL, TELL, OK, ERR = "call", "tell", "ok", "err"


def request(kind: str, call_id: int, method: str, args: tuple, kwargs: dict) -> dict:
    """Build a request envelope. ``kind`` is ``"call"`` (expects a reply) or ``"tell"``."""
    return {"k": kind, "id": call_id, "m": method, "a": list(args), "kw": kwargs}


def ok_reply(call_id: int, value: Any) -> dict:
    """Build a success reply carrying ``value``."""
    return {"k": OK, "id": call_id, "v": value}


def err_reply(call_id: int, type_name: str, message: str, traceback_text: str) -> dict:
    """Build an error reply: remote exception type name, message and formatted traceback, each
    cut to a bounded length (:func:`replayrl.actors.log_limit.clip`; the traceback keeps its end), so a
    hostile request cannot make the reply large."""
    return {"k": ERR, "id": call_id, "t": clip(type_name, 200), "msg": clip(message),
            "tb": clip(traceback_text, MAX_TRACEBACK_TEXT, keep_end=True)}


def parse_request(msg: Any) -> tuple[str, int, str, list, dict]:
    """Validate a decoded request envelope.

    Returns:
        ``(kind, call_id, method, args, kwargs)``.
    Raises:
        ProtocolError: not a dict, unknown kind, missing / mistyped field.
    """
    if not isinstance(msg, dict):
        raise ProtocolError(f"request must be a dict, got {type(msg).__name__}")
    kind, call_id, method = msg.get("k"), msg.get("id"), msg.get("m")
    args, kwargs = msg.get("a", []), msg.get("kw", {})
    if kind not in (CALL, TELL):
        raise ProtocolError(f"request field 'k' must be 'call' or 'tell', got {kind!r}")
    if not isinstance(call_id, int) or isinstance(call_id, bool):
        raise ProtocolError(f"request field 'id' must be an int, got {call_id!r}")
    if not isinstance(method, str) or not method:
        raise ProtocolError(f"request {call_id}: field 'm' must be a method name, got {method!r}")
    if not isinstance(args, (list, tuple)):
        raise ProtocolError(f"request {call_id}: field 'a' must be a list")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ProtocolError(f"request {call_id}: field 'kw' must be a dict with str keys")
    return kind, call_id, method, list(args), kwargs
