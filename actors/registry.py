"""A lazy registry: names mapped to ``"module:attr"`` strings, imported only when a name is used.

Five registries stand on it: the rollout engines, the tasks and the environments (rollout/), the
model families (rollout/model/families/) and the trainer backends (trainer/backends/). Their
entries are strings so that importing a registry imports none of them: a vLLM client,
megatron-core or a transformers model family is imported only by the run that picks it, and a
test registers a fake by adding one entry.

It lives in actors/ because that is the lowest layer both rollout/ and trainer/ may import
(tests/unit/test_layering.py's ``ALLOWED``; transport/ below it moves bytes and imports no
code by name), and because actors/ already imports code named by ``"module:qualname"`` strings
(:mod:`replayrl.actors.objects`: actor classes, hooks, reward functions). Like the rest of the
layer it knows nothing of models or RL: what a registry holds, and the errors that name its
flag or field, are its owner's.
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from replayrl.actors.objects import import_object

__all__ = ["LazyRegistry", "import_path"]


class LazyRegistry(MutableMapping[str, str]):
    """A view over ``entries`` (name -> ``"module:attr"``) that imports an entry on demand.

    Reads and writes go to ``entries`` itself, so its owner decides whether the registry can
    change: a ``dict`` takes a test's extra entry (``monkeypatch.setitem``), a
    ``types.MappingProxyType`` refuses it with ``TypeError``.

    Args:
        entries: name -> ``"package.module:attr"`` (or, for :func:`import_path`,
            ``"path/to/file.py:attr"``).
        unknown: builds the error for a name that is not registered:
            ``unknown(name, known)``, ``known`` the registered names sorted and joined by
            ``", "``.
        invalid: builds the error for an entry that cannot be imported or is not a ``base``:
            ``invalid(asked, why)``, ``asked`` the name (or path) the caller gave, ``why``
            ``"<path>: <import error>"`` or ``"<path> is not a <module>.<Class> subclass"``.
        base: the class every entry must be a subclass of, or its ``"module:Class"`` (imported
            on the first load, so that the registry does not import it); None: any object
            (the model families register instances).
        paths: whether a caller may give a ``"module:attr"`` path instead of a name
            (``--env module:Class``).
    """

    def __init__(self, entries: Mapping[str, str], *,
                 unknown: Callable[[Any, str], Exception],
                 invalid: Callable[[str, str], Exception],
                 base: type | str | None = None, paths: bool = False) -> None:
        self._entries = entries
        self._unknown = unknown
        self._invalid = invalid
        self._base = base
        self._paths = paths

    def __getitem__(self, name: str) -> str:
        return self._entries[name]

    def __setitem__(self, name: str, path: str) -> None:
        self._entries[name] = path  # type: ignore[index]  # TypeError for a read-only mapping

    def __delitem__(self, name: str) -> None:
        del self._entries[name]  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"LazyRegistry({dict(self._entries)!r})"

    def path(self, name: Any) -> str:
        """The ``"module:attr"`` registered under ``name``; with ``paths``, also ``name``
        itself when it has that form.

        Raises:
            the ``unknown`` error: ``name`` is not registered (nor, with ``paths``, a path);
                a non-string ``name`` included.
        """
        if isinstance(name, str):
            if name in self._entries:
                return self._entries[name]
            module, _, attr = name.rpartition(":")
            if self._paths and module and attr:
                return name
        raise self._unknown(name, ", ".join(sorted(self._entries)))

    def load(self, path: str, asked: str | None = None) -> Any:
        """The object at ``path`` (:func:`import_path`), checked against ``base``.

        Args:
            asked: what the caller named (a registered name), given to ``invalid``; default
                ``path``.
        Raises:
            the ``invalid`` error: not importable, or not a ``base`` subclass (names the path).
        """
        asked = path if asked is None else asked
        try:
            obj = import_path(path)
        except ValueError as exc:
            raise self._invalid(asked, str(exc)) from None
        base = import_object(self._base) if isinstance(self._base, str) else self._base
        if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
            raise self._invalid(asked, f"{path} is not a {base.__module__}.{base.__qualname__} "
                                       "subclass")
        return obj

    def resolve(self, name: Any) -> Any:
        """The object registered under ``name``, imported on this call: :meth:`path` then
        :meth:`load`.

        Raises:
            the ``unknown`` or the ``invalid`` error, as those.
        """
        return self.load(self.path(name), name)


def import_path(path: str) -> Any:
    """The object named ``"package.module:qualname"`` (:func:`replayrl.actors.objects.import_object`)
    or ``"path/to/file.py:qualname"``: a file outside any package (an example environment),
    run once as module ``replayrl_file_<stem>`` and run again only for another file of that
    stem.

    Raises:
        ValueError: not of those forms, no such file, or the module / attribute does not exist
            (names the path).
    """
    module, _, qualname = path.rpartition(":")
    if not module.endswith(".py"):
        return import_object(path)
    file, name = Path(module), f"replayrl_file_{Path(module).stem}"
    try:
        loaded = sys.modules.get(name)
        if loaded is None or getattr(loaded, "__file__", None) != str(file):
            spec = importlib.util.spec_from_file_location(name, file)
            if spec is None or spec.loader is None or not file.is_file():
                raise ImportError(f"no file {file}")
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[name] = loaded  # dataclasses in the file resolve their module
            spec.loader.exec_module(loaded)
        obj: Any = loaded
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return obj
