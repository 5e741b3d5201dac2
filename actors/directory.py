"""The directory of a run: actor names mapped to ZeroMQ endpoints.

The launcher fixes every endpoint before any process starts and hands the same immutable
directory to each actor, so no actor needs a name server to find another. A distributed run
writes it to a JSON file that every torchrun rank reads.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Mapping

from replayrl.actors.errors import UnknownActor
from replayrl.actors.proxy import ActorProxy
from replayrl.actors.ref import ActorRef, heartbeat_ms
from replayrl.transport import ipc_endpoint, strict_json, tcp_loopback_endpoint
from replayrl.transport.curve import CurveKeys
from replayrl.transport.shm_pool import DEFAULT_SHM_MIN_ARRAY_BYTES, DEFAULT_SHM_POOL_BYTES

DEFAULT_HEARTBEAT_DEADLINE_S = 30.0
"""Seconds of silence (no ZMTP heartbeat answered) after which a peer is lost by default."""


@dataclass(frozen=True)
class Directory:
    """Immutable mapping ``name -> endpoint`` (``ipc://...`` or ``tcp://host:port``), plus where
    the run's CURVE keys are (``curve_keys``, a directory written by ``replayrl keys``; required
    when any endpoint is tcp, docs/design/transport.md#transport-contract), the run's liveness
    deadline (``heartbeat_deadline_s``: a peer silent that long is lost, docs/design/engine-faults.md#engine-faults)
    and the shared-memory pool every process of the run uses for
    large arrays to ipc peers (``shm``: ``(max bytes, min array bytes)``,
    :func:`replayrl.actors.ref.use_shared_memory`; docs/design/transport.md#shm-transport).

    Raises:
        ValueError: a tcp endpoint without ``curve_keys``.
    """

    endpoints: Mapping[str, str] = field(default_factory=dict)
    curve_keys: str = ""
    heartbeat_deadline_s: float = DEFAULT_HEARTBEAT_DEADLINE_S
    shm: tuple[int, int] = (DEFAULT_SHM_POOL_BYTES, DEFAULT_SHM_MIN_ARRAY_BYTES)

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoints", MappingProxyType(dict(self.endpoints)))
        heartbeat_ms(self.heartbeat_deadline_s)  # a bad deadline fails here, not in a child
        if not self.curve_keys and any(e.startswith("tcp://") for e in self.endpoints.values()):
            raise ValueError("tcp endpoints need the run's CURVE keys (Directory.curve_keys; "
                             "`replayrl keys DIR` makes them)")

    @classmethod
    def for_run(cls, run_dir: str | Path, names: Iterable[str], transport: str = "ipc",
                base_port: int | None = None, curve_keys: str = "",
                heartbeat_deadline_s: float = DEFAULT_HEARTBEAT_DEADLINE_S,
                shm: tuple[int, int] = (DEFAULT_SHM_POOL_BYTES, DEFAULT_SHM_MIN_ARRAY_BYTES)) -> "Directory":
        """Endpoints for ``names``: ipc files under ``run_dir``, or loopback tcp ports.

        Args:
            transport: ``"ipc"`` (one node) or ``"tcp"`` (loopback; ``base_port`` + i, or a free
                port chosen by the OS when ``base_port`` is None).
            curve_keys: the run's key directory; required for tcp.
            heartbeat_deadline_s: seconds of silence after which a peer is lost.
            shm: the shared-memory pool's ``(max bytes, min array bytes)``.
        Raises:
            ValueError: unknown transport, or tcp without ``curve_keys``.
        """
        names = list(names)
        if transport == "ipc":
            return cls({n: ipc_endpoint(run_dir, n) for n in names}, curve_keys,
                       heartbeat_deadline_s, tuple(shm))
        if transport == "tcp":
            return cls({n: tcp_loopback_endpoint(_free_port() if base_port is None else base_port + i)
                        for i, n in enumerate(names)}, curve_keys, heartbeat_deadline_s,
                       tuple(shm))
        raise ValueError(f"unknown transport {transport!r}; expected 'ipc' or 'tcp'")

    def keys(self) -> CurveKeys | None:
        """The run's CURVE keys (None when the directory names none).

        Raises:
            replayrl.transport.TransportError: the key files are missing, unreadable or too open.
        """
        return CurveKeys.load(self.curve_keys) if self.curve_keys else None

    def endpoint(self, name: str) -> str:
        """The endpoint of ``name``. Raises :class:`UnknownActor`."""
        try:
            return self.endpoints[name]
        except KeyError:
            raise UnknownActor(f"no actor named {name!r}; known: {sorted(self.endpoints)}") from None

    def ref(self, name: str) -> ActorRef:
        """An :class:`ActorRef` to ``name``. Raises :class:`UnknownActor`."""
        return ActorRef(name, self.endpoint(name))

    def proxy(self, name: str, timeout: float | None = None) -> ActorProxy:
        """A typed :class:`ActorProxy` to ``name`` (``timeout`` in seconds, ``None`` = forever).

        Raises:
            UnknownActor: no actor of that name.
        """
        return ActorProxy(self.ref(name), timeout)

    def names(self) -> list[str]:
        """Actor names in insertion order."""
        return list(self.endpoints)

    def to_dict(self) -> dict[str, str]:
        """The endpoints as a plain dict, for messages and JSON."""
        return dict(self.endpoints)

    def save(self, path: str | Path) -> None:
        """Write the directory as JSON: ``{"endpoints": {...}, "curve_keys": path,
        "heartbeat_deadline_s": seconds, "shm": [max bytes, min array bytes]}``."""
        Path(path).write_text(strict_json.dumps({"endpoints": self.to_dict(),
                                                 "curve_keys": self.curve_keys,
                                                 "heartbeat_deadline_s": self.heartbeat_deadline_s,
                                                 "shm": list(self.shm)}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "Directory":
        """Read a directory written by :meth:`save`."""
        data = strict_json.loads(Path(path).read_text())
        shm = data.get("shm", (DEFAULT_SHM_POOL_BYTES, DEFAULT_SHM_MIN_ARRAY_BYTES))
        return cls(data["endpoints"], data.get("curve_keys", ""),
                   data.get("heartbeat_deadline_s", DEFAULT_HEARTBEAT_DEADLINE_S), tuple(shm))


def _free_port() -> int:
    """A loopback TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
