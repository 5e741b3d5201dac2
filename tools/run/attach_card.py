"""Finding a running run from outside it: the attach card and ``replayrl repl --attach``.

A run's launcher (``replayrl train``, and rank 0 of a torchrun run) writes
``<output-dir>/attach.json`` once every actor answers and removes it when the run ends
(docs/design/multi-host.md#attach-and-multi-host): the run's endpoints, where its CURVE
keys are and its output directory (``metrics.jsonl``). A console attaches either by that
directory (or the card itself) or by the address of any one actor (``tcp://host:port``,
``ipc://path``), which answers the built-in ``__directory__`` with every endpoint of the run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from replayrl.actors import ActorError, ActorRef, Directory
from replayrl.actors.ref import use_curve_keys
from replayrl.tools.errors import AttachError
from replayrl.transport import strict_json

__all__ = ["ATTACH_CARD", "AttachTarget", "write_attach_card",
           "remove_attach_card", "resolve_attach"]

ATTACH_CARD = "attach.json"
"""File name of the card in the run's output directory."""


@dataclass(frozen=True)
class AttachTarget:
    """What a console needs to reach a running run.

    Attributes:
        directory: the run's endpoints and CURVE key directory.
        output_dir: the run's output directory (``metrics.jsonl``); ``""`` when attached by an
            address (the driver's files are on its host).
        source: the path or address given, for messages.
    """

    directory: Directory
    output_dir: str
    source: str


def write_attach_card(output_dir: str | Path, directory: Directory) -> Path:
    """Write ``<output_dir>/attach.json`` (mode 0600, replaced atomically); returns its path.

    It holds paths and endpoints only, never a key: the CURVE secret stays in its own 0600 file.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    card = out / ATTACH_CARD
    partial = out / f".{ATTACH_CARD}.{os.getpid()}"
    text = strict_json.dumps({"endpoints": directory.to_dict(),
                              "curve_keys": str(Path(directory.curve_keys).resolve())
                              if directory.curve_keys else "",
                              "output_dir": str(out.resolve())}, indent=1)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(partial, card)
    return card


def remove_attach_card(output_dir: str | Path, directory: Directory) -> None:
    """Remove the card if it is still this run's (a later run into the same directory may have
    replaced it)."""
    card = Path(output_dir) / ATTACH_CARD
    try:
        if strict_json.loads(card.read_text()).get("endpoints") == directory.to_dict():
            card.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def _read_card(path: Path, curve_keys: str) -> AttachTarget:
    card = path / ATTACH_CARD if path.is_dir() else path
    try:
        data = strict_json.loads(card.read_text())
        endpoints, keys, output = data["endpoints"], data["curve_keys"], data["output_dir"]
        directory = Directory(endpoints, curve_keys or keys)
    except FileNotFoundError:
        raise AttachError(f"--attach {path}: no {ATTACH_CARD}: no run is live there (a run "
                          f"writes it into its --output-dir once its actors serve and removes "
                          f"it when it ends)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AttachError(f"--attach {card}: not an attach card: {type(exc).__name__}: {exc}") from None
    return AttachTarget(directory, str(output), str(path))


async def resolve_attach(target: str, curve_keys: str = "", timeout: float = 10.0) -> AttachTarget:
    """The run at ``target``: an output directory or card path, or one actor's address.

    Must run inside the event loop that will make the console's calls. Sets this process's
    CURVE keys (:func:`replayrl.actors.ref.use_curve_keys`).

    Args:
        target: a directory holding ``attach.json``, the card itself, or ``tcp://host:port`` /
            ``ipc://path`` of any actor of the run.
        curve_keys: the run's key directory (``--curve-keys``); needed for a tcp address,
            overrides the card's.
        timeout: seconds the address, and then every actor, gets to answer.
    Raises:
        AttachError: no card, a malformed card, a tcp address without keys, an actor that does
            not answer (the run ended, the keys are not the run's, or the address is wrong).
    """
    if "://" in target:
        if target.startswith("tcp://") and not curve_keys:
            raise AttachError(f"--attach {target}: a tcp run needs its CURVE keys: pass "
                              f"--curve-keys DIR")
        try:
            directory = Directory({"run": target}, curve_keys)
            use_curve_keys(directory.keys())
            endpoints = await ActorRef("run", target).call("__directory__", timeout=timeout)
            found = AttachTarget(Directory(endpoints, curve_keys), "", target)
        except Exception as exc:  # ActorError, a malformed address or key directory
            raise AttachError(f"--attach {target}: no actor answered ({type(exc).__name__}: "
                              f"{exc}); is the run live, and are these its keys?") from None
    else:
        found = _read_card(Path(target), curve_keys)
    try:
        use_curve_keys(found.directory.keys())
    except Exception as exc:  # replayrl.transport.TransportError: unreadable or too open key files
        raise AttachError(f"--attach {target}: {exc}") from None
    for name in found.directory.names():
        try:
            await found.directory.ref(name).call("__ping__", timeout=timeout)
        except ActorError as exc:
            raise AttachError(f"--attach {target}: actor {name!r} at "
                              f"{found.directory.endpoint(name)} does not answer "
                              f"({type(exc).__name__}: {exc}); the run has ended or the card "
                              f"is stale") from None
    return found
