"""A :class:`replayrl.tools.run.config.RunConfig` from flag values.

Precedence: built-in defaults < the task's own flag defaults < ``--config FILE`` < command-line
flags (:func:`config_from_args`); :func:`build_config` builds a config from flag name -> value
(what tests and the benchmarks use).
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.tasks import TaskConfigError, load_task_class, task_class_path, task_name
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.config import RunConfig
from replayrl.tools.run.config_file import read_config_file
from replayrl.tools.run.flags import FLAGS, SECTIONS
from replayrl.trainer.config import TrainerConfig


def build_config(values: dict[str, Any]) -> RunConfig:
    """A :class:`RunConfig` from flag-name -> value (dashes), over the defaults.

    Raises:
        ConfigError: unknown key, or a value any section rejects (its message names the flag).
    """
    sections: dict[str | None, dict[str, Any]] = {section: {} for section in SECTIONS}
    for key, value in values.items():
        flag = FLAGS.get(key)
        if flag is None:
            raise ConfigError(f"unknown config key --{key}")
        if flag.setting.repeat:
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"--{key} must be a list of "
                                  f"{flag.setting.metavar.lower() or 'str'} strings")
            value = tuple(value)
        for section, name in flag.targets:
            sections[section][name] = value
    _task_flag_defaults(values, sections)
    try:
        rollout = RolloutConfig(**sections["rollout"])
        trainer = TrainerConfig(**sections["trainer"])
        config = RunConfig(rollout=rollout, trainer=trainer, **sections[None])
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return _resolve_indexer_replay(config, asked=values.get("use-indexer-replay") is True)


def _task_flag_defaults(values: dict[str, Any], sections: dict[str | None, dict[str, Any]]) -> None:
    """Each flag the run's task sets a default of (``Task.flag_defaults``, e.g. the sort task's
    ``--rollout-max-response-len``) and ``values`` leaves out is set, in ``sections`` (the
    keyword arguments of each section's config). An unknown task or settings the task refuses
    are left for the run configuration's own checks to name."""
    try:
        rollout = RolloutConfig(**sections["rollout"])
        defaults = load_task_class(task_class_path(task_name(rollout))).flag_defaults(rollout)
    except (TypeError, ValueError, TaskConfigError):
        return
    for key, value in defaults.items():
        if key not in values:
            for section, name in FLAGS[key].targets:
                sections[section][name] = value


def _resolve_indexer_replay(config: RunConfig, asked: bool) -> RunConfig:
    """A policy without an indexer block: indexer replay is not applicable, so it is turned
    off in the config (and in the run's record); asking for it (``--use-indexer-replay``
    given) is an error rather than a run that silently replays nothing."""
    if config.policy_config.indexed_layers or not config.trainer.use_indexer_replay:
        return config
    if asked:
        raise ConfigError(f"--use-indexer-replay: --hf-checkpoint {config.hf_checkpoint} has no "
                          f"indexer (config.json lacks a replayrl_indexer block with index_topk "
                          f"> 0); drop the flag, indexer replay is not applicable to this model")
    return replace(config, trainer=replace(config.trainer, use_indexer_replay=False))


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Merge ``--config`` file values and the flags given on the command line."""
    values = read_config_file(args.config) if getattr(args, "config", None) else {}
    values.update({k.replace("_", "-"): v for k, v in vars(args).items()
                   if k.replace("_", "-") in FLAGS})
    return build_config(values)
