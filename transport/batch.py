"""Several small messages in one ZeroMQ message: the batch frame (docs/design/transport.md#shm-transport,
"Batches").

A socket that has more than one single-frame message ready for one peer in one loop iteration
sends them as one ZeroMQ message of one frame (``replayrl.transport.sockets``), so a burst of N small
messages costs one ZeroMQ message (one wake-up of libzmq's I/O thread and of the receiver)
instead of N. Layout, all integers little-endian uint32:

    0xC1 | count | length[0] ... length[count-1] | body[0] ... body[count-1]

``0xC1`` is the one byte msgpack never uses, so no codec header starts with it; a single-frame
message whose own first byte is 0xC1 is sent as a batch of one, which keeps the two apart for
any payload. Each body is the frame of one message, delivered in order.

Receiving checks the whole frame before anything is delivered: a batch holds at most
:data:`MAX_BATCH_MESSAGES` messages, every length is > 0 and the lengths add up to the frame
exactly. A malformed batch is refused whole with a :class:`replayrl.transport.DecodeError` that names
the first bad element; each body is then an ordinary message, checked by the codec's limits as
if it had come alone.
"""
from __future__ import annotations

import struct

from replayrl.transport.errors import DecodeError

__all__ = ["BATCH_MARKER", "MAX_BATCH_MESSAGES", "MAX_BATCH_ELEMENT_BYTES", "MAX_BATCH_BYTES",
           "is_batch", "pack_batch", "split_batch"]

BATCH_MARKER = 0xC1
"""First byte of a batch frame: msgpack's one unused byte ("never used" in its spec)."""

MAX_BATCH_MESSAGES = 4096
"""Most messages in one batch; a receiver refuses more (and a socket's reader counts each one
towards its per-wake-up limit, ``replayrl.transport.sockets.MAX_MESSAGES_PER_WAKEUP``)."""

MAX_BATCH_ELEMENT_BYTES = 64 << 10
"""Single-frame messages of at least this many bytes go alone, not in a batch (joining copies
them once more); unit: bytes."""

MAX_BATCH_BYTES = 1 << 20
"""A sender starts a new batch before one would pass this many bytes (and never passes its
socket's ``max_message_bytes``, the peer's ZMQ_MAXMSGSIZE); unit: bytes."""

_HEAD = struct.Struct("<BI")


def is_batch(frame: memoryview) -> bool:
    """True when ``frame`` (a received message's only frame) is a batch frame."""
    return len(frame) > 0 and frame[0] == BATCH_MARKER


def batch_overhead(count: int) -> int:
    """Bytes a batch of ``count`` messages adds to their bodies (marker, count, lengths)."""
    return _HEAD.size + 4 * count


def pack_batch(bodies: list[bytes]) -> bytes:
    """One batch frame holding ``bodies`` (each the one frame of a message), in order.

    Raises:
        ValueError: no bodies, more than :data:`MAX_BATCH_MESSAGES`, or an empty body.
    """
    count = len(bodies)
    if not 0 < count <= MAX_BATCH_MESSAGES:
        raise ValueError(f"a batch holds 1..{MAX_BATCH_MESSAGES} messages, got {count}")
    lengths = [len(b) for b in bodies]
    if 0 in lengths:
        raise ValueError(f"batch element {lengths.index(0)} is empty")
    return b"".join([_HEAD.pack(BATCH_MARKER, count), struct.pack(f"<{count}I", *lengths), *bodies])


def split_batch(frame: memoryview) -> list[memoryview]:
    """The messages of a batch frame, as zero-copy views of it, in order.

    Args:
        frame: a received frame with :func:`is_batch` true (1-D bytes view).

    Raises:
        DecodeError: a truncated head, a count of 0 or over :data:`MAX_BATCH_MESSAGES`, an
            empty element, or lengths that overrun the frame or leave bytes over; the message
            names the first bad element (``batch element i of n``). Nothing is delivered then.
    """
    total = len(frame)
    if total < _HEAD.size:
        raise DecodeError(f"batch frame of {total} bytes is shorter than its {_HEAD.size}-byte head")
    _, count = _HEAD.unpack_from(frame)
    if not 0 < count <= MAX_BATCH_MESSAGES:
        raise DecodeError(f"batch of {count} messages: a batch holds 1..{MAX_BATCH_MESSAGES}")
    offset = batch_overhead(count)
    if offset > total:
        raise DecodeError(f"batch of {count} messages: its lengths need {offset} bytes, the frame "
                          f"has {total}")
    views = []
    for i, length in enumerate(struct.unpack_from(f"<{count}I", frame, _HEAD.size)):
        end = offset + length
        if length == 0 or end > total:
            what = "is empty" if length == 0 else (f"of {length} bytes at offset {offset} runs past "
                                                    f"the end of the {total}-byte frame")
            raise DecodeError(f"batch element {i} of {count} {what}")
        views.append(frame[offset:end])
        offset = end
    if offset != total:
        raise DecodeError(f"batch of {count} messages: {total - offset} bytes after element "
                          f"{count - 1}, the last one")
    return views
