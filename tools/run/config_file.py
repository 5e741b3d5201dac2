"""``--config FILE``: flag values from a TOML or JSON file.

The file uses the flags' names with dashes or underscores (``rollout-batch-size = 16`` or
``rollout_batch_size = 16``), or it is a run's own record (``config.json``,
:meth:`replayrl.tools.run.config.RunConfig.to_json`), which gives back that run's settings.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import tomllib

from replayrl.actors.settings import Range
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.flags import FLAGS, SECTIONS


def read_config_file(path: Path) -> dict[str, Any]:
    """Flag name (dashes) -> value of the ``--config`` file ``path``, each value checked against
    its flag's type.

    Raises:
        ConfigError: the file is unreadable, not ``.toml`` / ``.json``, not valid in its format,
            or holds an unknown key, a key given twice or a value of the wrong type (the message
            names the file).
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(f"--config {path}: use a .toml or .json file")
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--config {path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: top level must be a table / object of flag = value")
    if any(isinstance(data.get(section), dict) for section in SECTIONS if section):
        return _read_record(data, path)
    values: dict[str, Any] = {}
    for raw, value in data.items():
        key = raw.replace("_", "-")
        if key in values:
            raise ConfigError(f"--config {path}: --{key} is given twice (as dashes and underscores)")
        if key not in FLAGS:
            raise ConfigError(f"--config {path}: unknown key {raw!r} (no flag --{key})")
        values[key] = _typed(key, value, path)
    return values


def _read_record(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """Flag values from a run's record (:meth:`RunConfig.to_json`, nested by section, field
    names): every field with a flag becomes that flag; a field without a flag must hold its
    default (a file cannot set what the command line cannot)."""
    flag_of = {target: name for name, flag in FLAGS.items() for target in flag.targets}
    values: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        fields = data if section is None else data.get(section, {})
        if not isinstance(fields, dict):
            raise ConfigError(f"--config {path}: {section!r} must be a table / object")
        defaults = {f.name: f for f in dataclass_fields(cls)}
        for name, value in fields.items():
            if section is None and name in SECTIONS:
                continue
            where = f"{section}.{name}" if section else name
            if name not in defaults:
                raise ConfigError(f"--config {path}: unknown field {where!r}")
            key = flag_of.get((section, name))
            if key is None:
                f = defaults[name]
                default = f.default_factory() if f.default is MISSING else f.default
                if value != default:
                    raise ConfigError(f"--config {path}: {where} = {value!r} has no flag "
                                      f"(only its default {default!r} can be read back)")
                continue
            value = _typed(key, value, path)
            if key in values and values[key] != value:
                raise ConfigError(f"--config {path}: --{key} is given twice with different "
                                  f"values ({values[key]!r} and {value!r})")
            values[key] = value
    return values


def _typed(key: str, value: Any, path: Path) -> Any:
    """A config-file value checked against its flag's type (argparse does this for flags);
    ints are accepted (and converted) for float flags, bools never for numbers. ``null`` is
    the flag's absent value where it has one: ``None`` where the range allows it
    (``--tis-cap``), the absent bound ``inf`` for a flag whose default is ``inf``
    (``--rs-upper``)."""
    s = FLAGS[key].setting
    if s.repeat:
        return value  # checked in build_config
    if value is None:
        if isinstance(s.check, Range) and None in s.check.also:
            return None
        if FLAGS[key].default == math.inf:
            return math.inf
    if s.type is bool:
        ok = isinstance(value, bool)
    else:
        ok = (isinstance(value, s.type) and not isinstance(value, bool)) or (
            s.type is float and isinstance(value, int) and not isinstance(value, bool))
        value = float(value) if ok and s.type is float else value
    if not ok:
        expected = "true/false" if s.type is bool else s.type.__name__
        raise ConfigError(f"--config {path}: --{key} must be {expected}, got {value!r}")
    return value
