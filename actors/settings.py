"""Settings fields: a config dataclass field that also carries its flag, help and allowed range.

One setting is written once, beside its dataclass field::

    lr: float = setting(3e-4, "lr", "AdamW learning rate", Range(low=0, closed="()"))

and everything else is generated from that metadata by ``tools/run/flags.py``: the argparse flag,
the config-file key and its type check, the flag table of docs/configuration.md, and (here, through
:func:`check_settings` called from ``__post_init__``) the single-field range check whose error
reads ``--lr must be > 0``. Checks that involve two fields stay explicit code in the dataclass.

Why this module lives in ``actors/``: both ``rollout/config.py`` and ``trainer/config.py`` use
it, the house import order is ``tools -> {rollout, trainer} -> actors -> transport``, and rollout
and trainer may not import each other, so it must sit in a layer below both. ``transport`` is
the wire format only; ``actors`` is the lowest layer the two sides already build on (their
actors and configs travel through it). The module is generic — standard library only, nothing
of RL, models or actors — so it keeps ``actors`` free of RL knowledge.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Range", "Choices", "Rule", "POSITIVE", "Setting", "setting", "settings_of", "check_settings",
           "show_value"]

_KEY = "setting"  # dataclasses.Field.metadata key holding the Setting


def show_value(value: Any) -> str:
    """``value`` as help texts and messages print it: ``2**32`` for large powers of two,
    ``inf``, ``on`` / ``off`` for booleans, ``repr`` of strings, ``str`` otherwise."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and value >= 1 << 16 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return repr(value) if abs(value) < 1e4 else str(int(value))
    if isinstance(value, str):
        return repr(value)
    return str(value)


@dataclass(frozen=True)
class Range:
    """Numeric range ``low .. high`` (either end may be open-ended, ``None``).

    Attributes:
        low, high: bounds; ``None`` = unbounded on that side.
        closed: which ends are included, ``"[]"``, ``"[)"``, ``"(]"`` or ``"()"``.
        also: values accepted outside the range (``-1`` for "off", ``None`` for "disabled").
        also_text: how ``also`` is described in messages (``"-1 (off)"``); empty = not shown.
        why: reason appended to the error message after ``": "``.

    Raises:
        ValueError: ``closed`` is not one of the four forms, or no bound is given.
    """

    low: float | None = None
    high: float | None = None
    closed: str = "[]"
    also: tuple = ()
    also_text: str = ""
    why: str = ""

    def __post_init__(self) -> None:
        if self.closed not in ("[]", "[)", "(]", "()"):
            raise ValueError(f"Range.closed must be [], [), (] or (), got {self.closed!r}")
        if self.low is None and self.high is None:
            raise ValueError("Range needs low, high or both")

    def ok(self, value: Any) -> bool:
        """Whether ``value`` is allowed. Raises TypeError for a non-number (not compared)."""
        if any(value is a or (type(value) is type(a) and value == a) for a in self.also):
            return True
        if self.low is not None and not (value >= self.low if self.closed[0] == "[" else value > self.low):
            return False
        return self.high is None or (value <= self.high if self.closed[1] == "]" else value < self.high)

    def describe(self) -> str:
        """``"> 0"``, ``">= 1"``, ``"in (0, 1]"``, ``"-1 (off) or >= 1"``."""
        if self.low is not None and self.high is not None:
            text = f"in {self.closed[0]}{show_value(self.low)}, {show_value(self.high)}{self.closed[1]}"
        elif self.low is not None:
            text = f"{'>=' if self.closed[0] == '[' else '>'} {show_value(self.low)}"
        else:
            text = f"{'<=' if self.closed[1] == ']' else '<'} {show_value(self.high)}"
        return f"{self.also_text} or {text}" if self.also_text else text


@dataclass(frozen=True)
class Choices:
    """One of a fixed set of values (``("bfloat16", "float32")``).

    Attributes:
        values: the allowed values, in the order messages list them.
        why: reason appended to the error message after ``": "``.
    """

    values: tuple
    why: str = ""

    def ok(self, value: Any) -> bool:
        """Whether ``value`` is one of :attr:`values`."""
        return value in self.values

    def describe(self) -> str:
        """``"bfloat16 or float32"``, ``"a, b or c"``."""
        names = [str(v) for v in self.values]
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(frozen=True)
class Rule:
    """Any other single-field condition: ``predicate(value)`` must be true.

    Attributes:
        predicate: ``value -> bool``.
        text: what the value must be, as the message says it (``"module:function"``).
        why: reason appended to the error message after ``": "``.
    """

    predicate: Callable[[Any], bool]
    text: str
    why: str = ""

    def ok(self, value: Any) -> bool:
        """``predicate(value)``."""
        return bool(self.predicate(value))

    def describe(self) -> str:
        """:attr:`text`."""
        return self.text


Check = Range | Choices | Rule

POSITIVE = Range(low=0, closed="()")
"""``> 0``: learning rates, timeouts, caps."""


@dataclass(frozen=True)
class Setting:
    """The metadata of one settings field (see :func:`setting`).

    Attributes:
        flag: command-line flag without the leading dashes (``"lr"``), or ``""`` for a field
            that has no flag (its messages then name the field).
        help: one line saying what the setting does; ``""`` on the second field of a flag that
            sets two fields (``--seed``), whose first field carries the help.
        check: the allowed values, or ``None`` for any value of the type.
        type: ``int``, ``float``, ``str`` or ``bool``; for a ``tuple`` default, the element
            type of a repeatable flag (given once per value).
        repeat: the flag may be given several times and the field holds a tuple of values.
        metavar: placeholder of the value in help (``"MODULE:FUNCTION"``); ``""`` = argparse's.
        default_text: the default as help shows it, when the field's default is a placeholder
            filled in later (``"<output-dir>/checkpoints"``); ``""`` = the field's default.
        nargs: values per occurrence of a repeatable flag (``--eval-prompt-data NAME FILE`` is
            2); the field holds every occurrence's values flattened, in order.
    """

    flag: str
    help: str
    check: Check | None = None
    type: type = str
    repeat: bool = False
    metavar: str = ""
    default_text: str = ""
    nargs: int = 1

    def message(self, name: str) -> str:
        """The error for a value outside :attr:`check` (``"--lr must be > 0"``); ``name`` is
        the field name, used when there is no flag."""
        who = f"--{self.flag}" if self.flag else name
        why = f": {self.check.why}" if self.check.why else ""
        return f"{who} must be {self.check.describe()}{why}"


def setting(default: Any, flag: str = "", help: str = "", check: Check | None = None, *,
            type: type | None = None, metavar: str = "", default_text: str = "",
            nargs: int = 1) -> Any:
    """A ``dataclasses.field`` with ``default`` and the :class:`Setting` metadata.

    Args:
        default: the field's default; its type is the flag's type (``int``, ``float``, ``str``,
            ``bool``), a ``tuple`` default makes a repeatable ``str`` flag.
        flag, help, check, metavar, default_text, nargs: see :class:`Setting`.
        type: overrides the type taken from ``default`` (e.g. ``float`` for a default of ``0``).
    Returns:
        The field (use as ``name: T = setting(...)`` in a dataclass body).
    Raises:
        TypeError: the type is not one of those above.
    """
    repeat = isinstance(default, tuple)
    kind = type or (str if repeat else _type_of(default))
    if kind not in (int, float, str, bool):
        raise TypeError(f"setting {flag or '?'}: unsupported type {kind!r}")
    return dataclasses.field(default=default, metadata={_KEY: Setting(
        flag, help, check, kind, repeat, metavar, default_text, nargs)})


def _type_of(value: Any) -> type:
    return type(value)  # outside setting(), whose ``type`` argument shadows the builtin


def settings_of(cls: type) -> list[tuple[dataclasses.Field, Setting]]:
    """``(field, setting)`` of every field of the dataclass ``cls`` made by :func:`setting`,
    in field order. Raises TypeError when ``cls`` is not a dataclass."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def check_settings(obj: Any, error: type[Exception]) -> None:
    """Check every settings field of the dataclass instance ``obj`` against its range.

    Call first thing in ``__post_init__``; fields are checked in order and the first failure
    raises. A value of the wrong type for its range (a ``str`` where a number belongs) raises
    the ``TypeError`` of the comparison.

    A float outside ``Range.also`` that is not finite (inf, NaN) is refused for every ranged
    setting: ``--lr inf`` would pass ``> 0`` and fail only inside the first training step.

    Raises:
        error: ``error(setting.message(name))``, e.g. ``TrainerConfigError("--lr must be > 0")``,
            or ``"--lr must be a finite number (> 0), got inf"``.
    """
    for f, s in settings_of(type(obj)):
        value = getattr(obj, f.name)
        if (isinstance(s.check, Range) and isinstance(value, float) and not math.isfinite(value)
                and not any(value is a for a in s.check.also)):
            # a range bounds a real number: inf passes "> 0" but no consumer can use it (an inf
            # learning rate or clip), and NaN fails every comparison silently
            who = f"--{s.flag}" if s.flag else f.name
            raise error(f"{who} must be a finite number ({s.check.describe()}), got {value}")
        if s.check is not None and not s.check.ok(value):
            raise error(s.message(f.name))
