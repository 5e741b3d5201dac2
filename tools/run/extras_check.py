"""What the run's optional features need from this machine, checked before any process starts:
the extra's package (``--lora-rank``: peft, ``--use-tensorboard``, ``--use-wandb``) and, for
``--use-wandb``, a way to log in (an API key, or offline mode).

Without these checks the run started its actors first and failed there: a LoRA run without peft
in the trainer's constructor (exit 1, its traceback twice), a wandb run without a key when the
recorder called ``wandb.init`` (no word of offline mode). Nothing here imports the packages
(peft imports torch): ``importlib.util.find_spec`` finds them.
"""
from __future__ import annotations

import configparser
import importlib.util
import netrc
import os
from pathlib import Path
from typing import Mapping
from urllib.parse import urlsplit

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.config import RunConfig

WANDB_OFFLINE_MODES = ("offline", "dryrun", "disabled")
"""``WANDB_MODE`` values under which wandb needs no API key."""

WANDB_HOST = "https://api.wandb.ai"
"""The W&B server when ``WANDB_BASE_URL`` does not name another."""


def require_extra(wanted_by: str, package: str, extra: str) -> None:
    """Refuse ``wanted_by`` (a flag or a command) when ``package`` is not installed, without
    importing it.

    Raises:
        ConfigError: ``"<wanted_by> needs the <package> package: pip install 'replayrl[<extra>]'"``.
    """
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{wanted_by} needs the {package} package: pip install 'replayrl[{extra}]'")


def check_extras(config: RunConfig, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a run whose optional features cannot work here (module docstring).

    Args:
        environ: the environment wandb would read (default: this process's).
    Raises:
        ConfigError: ``--lora-rank`` without peft, ``--use-tensorboard`` without tensorboard,
            ``--use-wandb`` without wandb, or without an API key outside offline mode (the
            message names the flag, the extra to install or ``WANDB_MODE=offline``).
    """
    needs = [(config.trainer.lora_rank > 0, f"--lora-rank {config.trainer.lora_rank}", "peft", "lora"),
             (config.use_tensorboard, "--use-tensorboard", "tensorboard", "tensorboard"),
             (config.use_wandb, "--use-wandb", "wandb", "wandb")]
    for wanted, flag, package, extra in needs:
        if wanted:
            require_extra(flag, package, extra)
    if config.use_wandb and (problem := wandb_login_problem(os.environ if environ is None else environ)):
        raise ConfigError(f"--use-wandb: {problem}")


def wandb_login_problem(environ: Mapping[str, str]) -> str | None:
    """Why ``wandb.init`` would find no API key under ``environ``, or None when it would (or
    needs none). Looked up as wandb looks (``wandb login --help``): ``WANDB_MODE`` offline /
    dryrun / disabled needs none; else ``WANDB_API_KEY``, the ``api_key`` of wandb's settings
    file (``$WANDB_CONFIG_DIR/settings``, default ``~/.config/wandb/settings``), or a netrc
    entry (``$NETRC``, ``~/.netrc`` or ``~/_netrc``) for the host of ``WANDB_BASE_URL``."""
    if environ.get("WANDB_MODE", "").lower() in WANDB_OFFLINE_MODES or environ.get("WANDB_API_KEY"):
        return None
    home = Path(environ.get("HOME") or Path.home())
    settings = configparser.ConfigParser()
    config_dir = Path(environ.get("WANDB_CONFIG_DIR") or home / ".config" / "wandb")
    try:
        settings.read(config_dir / "settings")
    except configparser.Error:
        pass
    if settings.get("default", "api_key", fallback=""):
        return None
    host = urlsplit(environ.get("WANDB_BASE_URL") or WANDB_HOST).netloc
    files = ([Path(environ["NETRC"]).expanduser()] if environ.get("NETRC")
             else [home / ".netrc", home / "_netrc"])
    for path in files:
        try:
            if path.is_file() and netrc.netrc(str(path)).authenticators(host):
                return None
        except (netrc.NetrcParseError, OSError):
            continue
    return (f"no Weights & Biases API key for {host} (WANDB_API_KEY, `wandb login`'s netrc entry "
            f"or its settings file); set WANDB_MODE=offline to log to <output-dir>/wandb without "
            f"one (`wandb sync` uploads it later), or log in first")
