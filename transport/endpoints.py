"""ZeroMQ endpoint strings: builders and the checks applied before bind/connect.

``ipc://`` on one node, ``tcp://`` across nodes (docs/design/transport.md#transport-contract). A tcp
listener may bind any address, loopback or not: every tcp socket is CURVE-authenticated with the
run's keys (``replayrl.transport.sockets`` refuses a tcp socket without them), so the address does not
decide who may call (docs/design/multi-host.md#attach-and-multi-host).
"""

from __future__ import annotations

import os
from pathlib import Path

from replayrl.transport.errors import TransportError

__all__ = [
    "IPC_PATH_MAX_BYTES",
    "ipc_endpoint",
    "tcp_loopback_endpoint",
    "check_bind_endpoint",
    "check_connect_endpoint",
    "shares_memory",
]

IPC_PATH_MAX_BYTES = 107
"""Longest ipc socket path: ``sockaddr_un.sun_path`` is 108 bytes on Linux including the NUL."""

_SCHEMES = ("ipc", "tcp", "inproc")


def ipc_endpoint(directory: str | Path, name: str) -> str:
    """Build ``ipc://<abs directory>/<name>``.

    Args:
        directory: directory of the socket file (made absolute, so processes with different
            working directories agree); it need not exist yet, ``RouterSocket.bind`` creates it.
        name: file name, one path component.

    Returns:
        The endpoint string.

    Raises:
        TransportError: ``name`` is empty, ``.``/``..`` or contains a path separator or NUL, or
            the encoded path is longer than :data:`IPC_PATH_MAX_BYTES` (107) bytes.
    """
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise TransportError(f"ipc socket name must be one non-empty path component, got {name!r}")
    path = os.path.join(os.path.abspath(os.fspath(directory)), name)
    _check_ipc_path(path)
    return f"ipc://{path}"


def tcp_loopback_endpoint(port: int = 0) -> str:
    """Build ``tcp://127.0.0.1:<port>``; port 0 lets the OS pick a free port at bind time (read
    the chosen one from ``RouterSocket.endpoint`` after ``bind()``).

    Raises:
        TransportError: ``port`` is not an int in [0, 65535].
    """
    if type(port) is not int or not 0 <= port <= 65535:
        raise TransportError(f"tcp port must be an int in [0, 65535], got {port!r}")
    return f"tcp://127.0.0.1:{port}"


def shares_memory(endpoint: str) -> bool:
    """True for an ``ipc://`` endpoint: its peer is a process of this user on this node, so
    large arrays may travel through the shared-memory pool (docs/design/transport.md#shm-transport);
    a ``tcp://`` peer may be on another host and gets them as frames."""
    return isinstance(endpoint, str) and endpoint.startswith("ipc://")


def _split(endpoint: str) -> tuple[str, str]:
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise TransportError(f"endpoint must be a string like 'ipc://path' or 'tcp://host:port', got {endpoint!r}")
    scheme, rest = endpoint.split("://", 1)
    if scheme not in _SCHEMES:
        raise TransportError(f"endpoint {endpoint!r}: unsupported transport {scheme!r} (use one of {_SCHEMES})")
    if not rest:
        raise TransportError(f"endpoint {endpoint!r} has no address")
    return scheme, rest


def _check_ipc_path(path: str) -> None:
    if path == "*":
        raise TransportError("ipc wildcard 'ipc://*' is not supported; name the socket file (see ipc_endpoint)")
    if "\0" in path:
        raise TransportError(f"ipc path {path!r} contains NUL")
    n = len(os.fsencode(path))
    if n > IPC_PATH_MAX_BYTES:
        raise TransportError(
            f"ipc path {path!r} is {n} bytes, over the AF_UNIX limit of {IPC_PATH_MAX_BYTES}; use a shorter directory"
        )


def _split_host_port(endpoint: str, rest: str) -> tuple[str, str]:
    if rest.startswith("["):  # [ipv6]:port
        host, sep, port = rest[1:].partition("]:")
    else:
        host, sep, port = rest.rpartition(":")
    if not sep or not host or not port:
        raise TransportError(f"endpoint {endpoint!r}: expected tcp://host:port")
    if port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
        raise TransportError(f"endpoint {endpoint!r}: port {port!r} is not in [0, 65535]")
    return host, port


def check_bind_endpoint(endpoint: str) -> tuple[str, str | None]:
    """Validate an endpoint for ``bind``.

    Returns:
        ``(scheme, ipc_file)`` where ``ipc_file`` is the socket file path for a file-backed
        ``ipc://`` endpoint, else ``None`` (tcp, inproc, Linux abstract ``ipc://@name``).

    Raises:
        TransportError: unsupported transport, malformed address or ipc path over 107 bytes.
            (Any tcp host is accepted here; the socket refuses tcp without CURVE keys.)
    """
    scheme, rest = _split(endpoint)
    if scheme == "ipc":
        _check_ipc_path(rest)
        return scheme, None if rest.startswith("@") else rest
    if scheme == "tcp":
        _split_host_port(endpoint, rest)
    return scheme, None


def check_connect_endpoint(endpoint: str) -> str:
    """Validate an endpoint for ``connect``; any tcp host is accepted.

    Returns:
        The scheme (``"ipc"``, ``"tcp"`` or ``"inproc"``).

    Raises:
        TransportError: unsupported transport, malformed tcp address or ipc path over 107 bytes.
    """
    scheme, rest = _split(endpoint)
    if scheme == "ipc":
        _check_ipc_path(rest)
    elif scheme == "tcp":
        _split_host_port(endpoint, rest.rpartition(";")[2])  # "tcp://src;dst": check dst
    return scheme
