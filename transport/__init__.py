"""ZeroMQ transport: a msgpack codec with out-of-band array frames and asyncio-driven sockets.

Knows nothing of RL (docs/design/layout.md#layout). Public names:

* errors: :class:`TransportError`, :class:`EncodeError`, :class:`DecodeError`,
  :class:`MessageTooLarge`;
* codec: :class:`Codec`, :class:`CodecConfig`, :func:`encode`, :func:`decode`,
  :data:`DEFAULT_INLINE_THRESHOLD`, :data:`DEFAULT_MAX_MESSAGE_BYTES`, :data:`DEFAULT_ALLOWED_DTYPES`;
* sockets: :class:`RouterSocket`, :class:`DealerSocket`, :func:`owned_frames`,
  :func:`ipc_endpoint`, :func:`tcp_loopback_endpoint`;
* :mod:`replayrl.transport.strict_json`: the one writer / reader of JSON files and lines (no NaN or
  infinity: strict parsers refuse them);
* :mod:`replayrl.transport.curve`: a run's CurveZMQ keys (``replayrl keys``), required by every tcp
  socket;
* :mod:`replayrl.transport.batch`: the batch frame in which a socket sends several small messages as
  one ZeroMQ message;
* :mod:`replayrl.transport.tensor_data`: :class:`~replayrl.transport.tensor_data.TensorData`, a tensor decoded
  in a process without torch.
"""

from replayrl.transport.codec import (
    DEFAULT_ALLOWED_DTYPES,
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_MAX_MESSAGE_BYTES,
    Codec,
    CodecConfig,
    decode,
    encode,
)
from replayrl.transport.endpoints import ipc_endpoint, tcp_loopback_endpoint
from replayrl.transport.errors import DecodeError, EncodeError, MessageTooLarge, TransportError
from replayrl.transport.sockets import DealerSocket, RouterSocket, owned_frames

__all__ = [
    "TransportError",
    "EncodeError",
    "DecodeError",
    "MessageTooLarge",
    "DEFAULT_INLINE_THRESHOLD",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_ALLOWED_DTYPES",
    "CodecConfig",
    "Codec",
    "encode",
    "decode",
    "RouterSocket",
    "DealerSocket",
    "owned_frames",
    "ipc_endpoint",
    "tcp_loopback_endpoint",
]
