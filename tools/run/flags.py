"""The run's command-line flags, generated from the settings fields: slime-style names.

Every flag maps to a field of :class:`replayrl.tools.run.config.RunConfig` (run level),
:class:`replayrl.rollout.config.RolloutConfig` or :class:`replayrl.trainer.config.TrainerConfig`
(``--seed`` and ``--rollout-temperature`` to one field of each side). A flag's name, default,
help and range are declared once, on its field, with :func:`replayrl.actors.settings.setting`;
:data:`FLAGS` collects them, and the argparse flags (:func:`add_run_flags`), the config-file keys
and type checks (:mod:`replayrl.tools.run.config_file`) and the flag table of
docs/configuration.md (:func:`flag_table_markdown`, printed by ``python -m
replayrl.tools.run.flags``) are generated from it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable

from replayrl.actors.settings import Setting, settings_of, show_value
from replayrl.rollout.config import RolloutConfig
from replayrl.tools.run.config import RunConfig
from replayrl.trainer.config import TrainerConfig

SECTIONS: dict[str | None, type] = {None: RunConfig, "rollout": RolloutConfig,
                                    "trainer": TrainerConfig}
"""Where flags land: ``None`` is :class:`RunConfig` itself, the others its two sub-configs."""


@dataclass(frozen=True)
class Flag:
    """One command-line flag / config-file key, built from the fields that declare it.

    Attributes:
        setting: flag, help, range, type (the declaration that carries the help).
        targets: ``(section, field name)`` of every field the flag sets; ``--seed`` and
            ``--rollout-temperature`` set one field in each of rollout and trainer.
        default: the fields' default (the same in every target).
    """

    setting: Setting
    targets: tuple[tuple[str | None, str], ...]
    default: Any

    @property
    def name(self) -> str:
        """The flag without the leading dashes (``"num-steps"``)."""
        return self.setting.flag

    def shown_default(self, markdown: bool = False) -> str:
        """The default as ``--help`` (``repr`` of strings) or docs/configuration.md (code spans) shows it;
        ``—`` for an empty string or tuple."""
        s = self.setting
        if s.default_text:
            return f"`{s.default_text}`" if markdown else s.default_text
        if self.default in ("", ()):
            return "—"
        if markdown and isinstance(self.default, str):
            return f"`{self.default}`"
        return show_value(self.default)


def collect_flags(sections: dict[str | None, type]) -> dict[str, Flag]:
    """Every :func:`replayrl.actors.settings.setting` field with a flag of the dataclasses in
    ``sections`` (section -> class, e.g. :data:`SECTIONS`), by flag name, in section order
    (run, rollout, trainer) then field order.

    Raises:
        TypeError: two fields share a flag but not its type and default, or both carry a
            different help text (a programming error, raised at import).
    """
    found: dict[str, list[tuple[str | None, Any, Setting]]] = {}
    for section, cls in sections.items():
        for f, s in settings_of(cls):
            if s.flag:
                found.setdefault(s.flag, []).append((section, f, s))
    flags = {}
    for name, decls in found.items():
        kinds = {(s.type, s.repeat, f.default) for _, f, s in decls}
        helps = {s.help for _, _, s in decls if s.help}
        if len(kinds) != 1 or len(helps) != 1:
            raise TypeError(f"--{name} is declared by {[f.name for _, f, _ in decls]} with "
                            f"differing type / default or help texts {sorted(helps)}")
        carrier = next(s for _, _, s in decls if s.help)
        flags[name] = Flag(carrier, tuple((sec, f.name) for sec, f, _ in decls), decls[0][1].default)
    return flags


FLAGS: dict[str, Flag] = collect_flags(SECTIONS)
"""flag name (no dashes) -> :class:`Flag`: the argparse flags, config-file keys and docs/configuration.md rows."""


def add_run_flags(parser: argparse.ArgumentParser, only: Collection[str] | None = None) -> None:
    """Add ``--config`` and every flag of :data:`FLAGS` (or only those named in ``only``,
    without dashes) to ``parser``.

    Defaults are suppressed (``argparse.SUPPRESS``), so only the flags given on the command line
    override the config file; booleans get ``--x`` / ``--no-x``, repeatable flags append.

    Raises:
        KeyError: a name in ``only`` is no flag of :data:`FLAGS` (a programming error).
    """
    if only is not None:
        unknown = sorted(set(only) - set(FLAGS))
        if unknown:
            raise KeyError(f"add_run_flags: no such run flag(s) {unknown}")
    parser.add_argument("--config", type=Path, help="TOML or JSON file with the same keys as the flags "
                        "(dashes or underscores), at the top level or in [rollout] / [trainer] "
                        "tables of that side's flags; or a run's config.json")
    add_flags(parser, [f for f in FLAGS.values() if only is None or f.name in only])


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Add each of ``flags`` to ``parser`` as :func:`add_run_flags` does (defaults suppressed,
    booleans as ``--x`` / ``--no-x``, repeatable flags appended): the flags of another command
    built from its own settings (``replayrl sft``)."""
    for flag in flags:
        s = flag.setting
        extra: dict[str, Any] = {"metavar": s.metavar} if s.metavar else {}
        help_ = s.help.replace("%", "%%")  # argparse %-formats help texts
        if s.type is bool:
            parser.add_argument(f"--{flag.name}", action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS,
                                help=f"{help_} (default: {flag.shown_default()})")
        elif s.repeat and s.nargs > 1:  # --eval-prompt-data NAME FILE: values flattened
            parser.add_argument(f"--{flag.name}", action="extend", nargs=s.nargs, type=s.type,
                                default=argparse.SUPPRESS, help=f"{help_} (repeatable)",
                                metavar=tuple(s.metavar.split()) if s.metavar else None)
        elif s.repeat:
            parser.add_argument(f"--{flag.name}", action="append", type=s.type,
                                default=argparse.SUPPRESS, help=f"{help_} (repeatable)", **extra)
        else:
            parser.add_argument(f"--{flag.name}", type=s.type, default=argparse.SUPPRESS,
                                help=f"{help_} (default: {flag.shown_default()})", **extra)


def flag_table_markdown() -> str:
    """The flag table of docs/configuration.md: one row per flag of :data:`FLAGS` with its default, allowed
    values and help, as GitHub markdown (``|`` in a cell escaped). ``tests/unit/test_docs.py``
    checks that docs/configuration.md contains exactly this; ``python -m replayrl.tools.run.flags`` prints it."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| flag | default | allowed | meaning |", "|---|---|---|---|"]
    for flag in FLAGS.values():
        s = flag.setting
        name = f"`--{flag.name}{' ' + s.metavar if s.metavar else ''}`"
        if s.type is bool:
            name += f" / `--no-{flag.name}`"
        allowed = s.check.describe() if s.check is not None else "—"
        meaning = s.help + (" (repeatable)" if s.repeat else "")
        rows.append(f"| {name} | {cell(flag.shown_default(markdown=True))} | {cell(allowed)} | "
                    f"{cell(meaning)} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(flag_table_markdown(), end="")
