"""Code named by a ``"package.module:qualname"`` string, imported on demand: actor classes of
:class:`~replayrl.actors.spec.ActorSpec`, hooks, reward functions."""
from __future__ import annotations

import importlib
from typing import Any

from replayrl.actors.actor import Actor


def import_object(path: str, what: str = "") -> Any:
    """The object named ``"package.module:qualname"`` (actor classes, hooks, reward functions).

    Args:
        what: the setting that named it (``"--custom-reward"``), put first in error messages.
    Raises:
        ValueError: not of that form, or the module / attribute does not exist (the message
            names ``what`` and ``path``).
    """
    prefix = f"{what} " if what else ""
    module, _, qualname = path.partition(":")
    if not module or not qualname:
        raise ValueError(f"{prefix}expected 'module:name', got {path!r}")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{prefix}{path}: {exc}") from None
    return obj


def import_callable(path: str, what: str = "") -> Any:
    """The callable named ``"package.module:qualname"`` (metrics hooks, reward functions).

    Args:
        what: the setting that named it, put first in error messages.
    Raises:
        ValueError: as :func:`import_object`, or the object is not callable.
    """
    obj = import_object(path, what)
    if not callable(obj):
        raise ValueError(f"{what + ' ' if what else ''}{path}: not callable")
    return obj


def import_actor_class(path: str) -> type[Actor]:
    """The Actor subclass named ``"package.module:ClassName"``.

    Raises:
        ValueError: as :func:`import_object`. TypeError: not an Actor subclass.
    """
    obj = import_object(path)
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise TypeError(f"{path} is not an Actor subclass")
    return obj
