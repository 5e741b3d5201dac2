"""``--config FILE``: flag values from a TOML or JSON file.

One layout for both formats and for a run's own record (``config.json``,
:meth:`replayrl.tools.run.config.RunConfig.to_json`, which gives back that run's settings):

- at the top level, any flag with dashes or underscores (``rollout-batch-size = 16`` or
  ``rollout_batch_size = 16``), or a run-level field name (``save_dir``);
- a ``[rollout]`` / ``[trainer]`` table (JSON: object) holds that side's settings, by flag
  name or by field name (``max_response_len``, as ``config.json`` writes them).

A field without a flag may only hold its default (a file cannot set what the command line
cannot). Any other table, a flag in the other side's table, an unknown key and one flag given
twice with different values are refused, naming the file and the table.
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

TABLES = tuple(section for section in SECTIONS if section)
"""The tables a config file may hold: the two sides, ``rollout`` and ``trainer``."""
LAYOUT = ("a config file holds flags at the top level (num-steps = 10, dashes or underscores) "
          "and may hold [rollout] / [trainer] tables of that side's flags or field names (the "
          "layout of a run's config.json)")
"""The accepted layout, said in every refusal of a table."""
_FLAG_OF = {target: name for name, flag in FLAGS.items() for target in flag.targets}


def read_config_file(path: Path) -> dict[str, Any]:
    """Flag name (dashes) -> value of the ``--config`` file ``path``, each value checked against
    its flag's type.

    Raises:
        ConfigError: the file is unreadable, not ``.toml`` / ``.json``, not valid in its format,
            or holds a table other than ``rollout`` / ``trainer``, a flag in the other side's
            table, an unknown key, a flag given twice (in one table; or with different values)
            or a value of the wrong type (the message names the file and the table).
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
    values: dict[str, Any] = {}
    seen: dict[tuple[str | None, str], str] = {}  # (table, flag) -> the key that set it there
    for table in (None, *TABLES):
        entries = data if table is None else data.get(table, {})
        if not isinstance(entries, dict):
            raise ConfigError(f"--config {path}: {table!r} must be a table / object")
        for raw, value in entries.items():
            if table is None and raw in TABLES:
                continue  # read as its table
            if table is None and isinstance(value, dict) and raw.replace("_", "-") not in FLAGS:
                raise ConfigError(f"--config {path}: {_table_name(path, raw)} is no section of "
                                  f"the run settings (only {' / '.join(TABLES)} are); {LAYOUT}")
            key = _flag_of(raw, value, table, path)
            if key is None:
                continue
            if (table, key) in seen:
                twice = ("as dashes and underscores" if seen[table, key].replace("_", "-") == raw.replace("_", "-")
                         else f"as {seen[table, key]!r} and {raw!r}")
                where = f" in {_table_name(path, table)}" if table else ""
                raise ConfigError(f"--config {path}: --{key} is given twice{where} ({twice})")
            seen[table, key] = raw
            value = _typed(key, value, path)
            if key in values and values[key] != value:
                raise ConfigError(f"--config {path}: --{key} is given twice with different "
                                  f"values ({values[key]!r} and {value!r})")
            values[key] = value
    return values


def _table_name(path: Path, table: str) -> str:
    """How the file's format writes a table: ``[rollout]`` in TOML, ``object 'rollout'`` in JSON."""
    return f"object {table!r}" if path.suffix == ".json" else f"[{table}]"


def _flag_of(raw: str, value: Any, table: str | None, path: Path) -> str | None:
    """The flag that key ``raw`` of ``table`` (None: the top level) sets: a field name of that
    section (a run's record) or a flag name (dashes or underscores); None for a field without a
    flag that holds its default.

    Raises:
        ConfigError: a field without a flag set to another value, a flag of the other side (or
            of the run level) in a side's table, or a key that is neither (names the table).
    """
    name = raw.replace("-", "_")
    fields = {f.name: f for f in dataclass_fields(SECTIONS[table])}
    if name in fields:  # a field of this section: no field name is another field's flag
        key = _FLAG_OF.get((table, name))
        if key is None:
            f = fields[name]
            default = f.default_factory() if f.default is MISSING else f.default
            if value != default:
                where = f"{table}.{name}" if table else name
                raise ConfigError(f"--config {path}: {where} = {value!r} has no flag "
                                  f"(only its default {default!r} can be read back)")
        return key
    key = raw.replace("_", "-")
    if table is None:
        if key not in FLAGS:
            raise ConfigError(f"--config {path}: unknown key {raw!r} (no flag --{key})")
        return key
    if key not in FLAGS:
        raise ConfigError(f"--config {path}: unknown key {raw!r} in {_table_name(path, table)} (no "
                          f"--{key} flag, no {table} field {name!r}); {LAYOUT}")
    sides = [section for section, _ in FLAGS[key].targets]
    if table not in sides:
        owner = f"a {sides[0]}" if sides[0] else "a run-level"
        instead = f"in {_table_name(path, sides[0])} or at the top level" if sides[0] else "at the top level"
        raise ConfigError(f"--config {path}: {_table_name(path, table)} sets {raw!r}, {owner} flag "
                          f"(--{key}): put it {instead}")
    return key


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
