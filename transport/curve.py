"""CurveZMQ keys of a run: every tcp socket is encrypted and authenticated (libzmq's built-in
CURVE mechanism with a ZAP handler from ``zmq.auth``).

Other local users reach loopback, so a tcp listener without authentication lets any of them
call any method of any actor (docs/design/transport.md#transport-contract). A run therefore has one
key pair, made by ``replayrl keys DIR`` (:func:`create_keys`) and read from that directory by
every process of the run (:meth:`CurveKeys.load`). Every actor's ROUTER is a CURVE server with
the run's key pair; every DEALER is a CURVE client with the same key pair; the ZAP handler of
each serving process (:func:`authorize`) admits exactly the run's public key. A peer without
the secret file completes no handshake, so it can call nothing. ipc sockets rely on their
directory's mode 0700 instead (:mod:`replayrl.transport.sockets`).
"""
from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from replayrl.transport.errors import TransportError

__all__ = ["CurveKeys", "create_keys", "authorize", "KEY_NAME"]

KEY_NAME = "run"
"""Files of a key directory: ``run.key`` (public) and ``run.key_secret`` (both keys, mode 0600)."""


@dataclass(frozen=True)
class CurveKeys:
    """A run's CURVE key pair, each key 40 bytes of Z85 text.

    Attributes:
        public: the public key (server key of every actor, the only client key admitted).
        secret: the secret key.
    """

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret into a log
        return f"CurveKeys(public={self.public!r}, secret=<hidden>)"

    @classmethod
    def load(cls, directory: str | Path) -> "CurveKeys":
        """Read ``directory/run.key_secret`` (written by :func:`create_keys`).

        Raises:
            TransportError: the file is missing, unreadable, not a key pair, or readable by
                other users (group / other permission bits set).
        """
        path = Path(directory) / f"{KEY_NAME}.key_secret"
        try:
            mode = path.stat().st_mode
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise TransportError(f"CURVE keys {path}: cannot read ({exc}); make them with "
                                 f"`replayrl keys {directory}`") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TransportError(f"CURVE keys {path}: mode {stat.S_IMODE(mode):o} lets other users "
                                 "read the secret key; chmod 600 it")
        if not public or not secret or len(public) != 40 or len(secret) != 40:
            raise TransportError(f"CURVE keys {path}: not a public / secret key pair")
        return cls(public, secret)


def create_keys(directory: str | Path) -> Path:
    """Make a new key pair in ``directory`` (created with mode 0700): ``run.key`` and
    ``run.key_secret`` (mode 0600). Returns the secret file's path.

    Raises:
        TransportError: a key pair is already there (never overwritten: running processes
            would lose each other) or the directory cannot be written.
    """
    out = Path(directory)
    secret = out / f"{KEY_NAME}.key_secret"
    if secret.exists():
        raise TransportError(f"{secret} exists; refusing to overwrite a run's keys")
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
        old = os.umask(0o077)  # the secret file is never readable by others, not even briefly
        try:
            zmq.auth.create_certificates(out, KEY_NAME)
        finally:
            os.umask(old)
        secret.chmod(0o600)
    except OSError as exc:
        raise TransportError(f"cannot write CURVE keys to {out}: {exc}") from None
    return secret


class _RunKeyOnly:
    """ZAP credentials provider: admits exactly one client public key (Z85 text, as
    ``zmq.auth`` passes it)."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


_AUTHENTICATORS: dict[int, ThreadAuthenticator] = {}
_LOCK = threading.Lock()


def authorize(context: zmq.Context, keys: CurveKeys) -> None:
    """Start (once per context) the ZAP handler that admits only ``keys.public`` on every CURVE
    server socket of ``context``. Call before the first such socket binds.

    Raises:
        TransportError: the context already admits another key (one run per process).
    """
    with _LOCK:
        auth = _AUTHENTICATORS.get(id(context))
        if auth is not None:
            admitted = auth.credentials_providers.get("*")
            if admitted is None or admitted.public != keys.public:
                raise TransportError("this process already serves CURVE sockets with other keys")
            return
        auth = ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=_RunKeyOnly(keys.public))
        _AUTHENTICATORS[id(context)] = auth
