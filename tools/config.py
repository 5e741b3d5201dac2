"""Run configuration: slime-style flags, an optional TOML/JSON config file, validation.

Precedence: built-in defaults < ``--config FILE`` < command-line flags. Every flag maps to one
field of :class:`RunConfig` (run level), :class:`rollout.config.RolloutConfig` or
:class:`trainer.config.TrainerConfig`; the config file uses the same names with dashes or
underscores (``rollout-batch-size = 16`` or ``rollout_batch_size = 16``).
"""
from __future__ import annotations

import argparse
import json
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout.config import RolloutConfig
from rollout.model.config import default_config
from rollout.task import VOCABULARY
from trainer.config import TrainerConfig


MAX_POSITIONS = default_config(len(VOCABULARY)).max_position_embeddings


class ConfigError(ValueError):
    """An unknown key, a bad value, or an unsupported combination (names the flags)."""


@dataclass(frozen=True)
class RunConfig:
    """Run-level settings plus the two sides' configs.

    Attributes:
        num_steps: optimizer steps (= rollouts) to run (``--num-steps``, slime ``--num-rollout``).
        max_staleness: VersionClock window (``--max-staleness``).
        num_engines: engine actors (``--num-engines``).
        engine_dtype: ``bfloat16`` or ``float32`` (``--engine-dtype``).
        output_dir: where metrics.jsonl, the plot and the checkpoint go (``--output-dir``).
        transport: ``ipc`` (one node) or ``tcp`` (loopback) (``--transport``).
        engine_torch_threads: intra-op threads per engine process.
        progress: show the live progress display.
        save_dir: checkpoint directory (``--save``; default ``<output_dir>/checkpoints``).
        save_interval: checkpoint every this many steps (``--save-interval``; 0 = never).
        load: checkpoint directory to resume from (``--load``).
        metrics_hooks: ``module:function`` loggers called after each step with the frozen
            config and a read-only view of the metrics (``--metrics-hook``, repeatable).
        rollout_engine: the rollout engine's registry name (``--rollout-engine``,
            ``rollout.engines.ENGINES``); the launcher rejects an unknown one.
    """

    num_steps: int = 400
    max_staleness: int = 1
    num_engines: int = 1
    engine_dtype: str = "bfloat16"
    output_dir: str = "runs/default"
    transport: str = "ipc"
    engine_torch_threads: int = 1
    progress: bool = True
    save_dir: str = ""
    save_interval: int = 0
    load: str = ""
    metrics_hooks: tuple[str, ...] = ()
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout_engine: str = "embedded"

    def __post_init__(self) -> None:
        checks = [
            (self.num_steps >= 1, "--num-steps must be >= 1"),
            (self.max_staleness >= 1, "--max-staleness must be >= 1: the loop overlaps generation "
                                      "of step k+1 with training of step k (one-step off-policy)"),
            (self.num_engines >= 1, "--num-engines must be >= 1"),
            (self.engine_dtype in ("bfloat16", "float32"), "--engine-dtype must be bfloat16 or float32"),
            (self.transport in ("ipc", "tcp"), "--transport must be ipc or tcp"),
            (self.save_interval >= 0, "--save-interval must be >= 0"),
            (self.engine_torch_threads >= 1, "--engine-torch-threads must be >= 1"),
            (self.rollout.top_k <= len(VOCABULARY),
             f"--rollout-top-k must be <= the vocabulary size {len(VOCABULARY)} (or -1)"),
            (self.max_context_tokens <= MAX_POSITIONS,
             f"--num-digits + 3 + --rollout-max-turns x (--rollout-max-response-len + 2) = "
             f"{self.max_context_tokens} tokens exceeds the model's {MAX_POSITIONS} positions"),
            (all(":" in h for h in self.metrics_hooks), "--metrics-hook must be module:function"),
            (self.trainer.temperature == self.rollout.temperature,
             "--rollout-temperature must reach the trainer unchanged (logprobs of logits / T)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.load:
            self._check_checkpoint()
        if not self.save_dir:
            object.__setattr__(self, "save_dir", str(Path(self.output_dir) / "checkpoints"))

    @property
    def max_context_tokens(self) -> int:
        """Longest trajectory the run can produce: prompt, turns and tool observations."""
        r = self.rollout
        return r.num_digits + 3 + r.max_turns * (r.max_response_len + 2)

    def _check_checkpoint(self) -> None:
        path = Path(self.load) / "run_state.json"
        try:
            state = json.loads(path.read_text())
            next_step = int(state["next_step"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--load {self.load}: not a readable replayrl checkpoint "
                              f"({path}: {type(exc).__name__}: {exc})") from None
        if next_step >= self.num_steps:
            raise ConfigError(f"--load {self.load} already completed {next_step} steps; "
                              f"--num-steps {self.num_steps} leaves nothing to do")
        saved = state.get("data_settings", {})
        changed = [f"--{k.replace('_', '-')} {saved[k]!r} -> {v!r}"
                   for k, v in self.data_settings().items() if k in saved and saved[k] != v]
        if changed:
            raise ConfigError(f"--load {self.load}: the checkpoint's data source was built with "
                              f"other settings ({'; '.join(changed)}); resuming would not "
                              f"continue the same run")

    def data_settings(self) -> dict[str, Any]:
        """The settings that define the prompt stream; a resume must keep them."""
        r = self.rollout
        return {"seed": r.seed, "rollout_batch_size": r.rollout_batch_size,
                "n_samples_per_prompt": r.n_samples_per_prompt, "num_digits": r.num_digits,
                "num_values": r.num_values, "dataset_size": r.dataset_size}

    def to_dict(self) -> dict:
        """Nested plain dict (written to ``output_dir/config.json``)."""
        return asdict(self)


# flag -> (section, field, type); section None = RunConfig itself
_FLAGS: dict[str, tuple[str | None, str, Any, str]] = {
    "num-steps": (None, "num_steps", int, "optimizer steps (one rollout each)"),
    "max-staleness": (None, "max_staleness", int, "max trainer_version - sample policy_version"),
    "num-engines": (None, "num_engines", int, "engine actor processes"),
    "engine-dtype": (None, "engine_dtype", str, "engine precision: bfloat16 | float32"),
    "output-dir": (None, "output_dir", str, "metrics, plot and checkpoint directory"),
    "transport": (None, "transport", str, "ipc (one node) | tcp (loopback)"),
    "engine-torch-threads": (None, "engine_torch_threads", int, "torch threads per engine"),
    "seed": ("both", "seed", int, "seed of data, sampling and init"),
    "rollout-batch-size": ("rollout", "rollout_batch_size", int, "prompt groups per step"),
    "n-samples-per-prompt": ("rollout", "n_samples_per_prompt", int, "trajectories per prompt"),
    "rollout-temperature": ("both", "temperature", float, "sampling temperature"),
    "rollout-top-k": ("rollout", "top_k", int, "top-k (-1 = whole vocabulary)"),
    "rollout-top-p": ("rollout", "top_p", float, "top-p (nucleus)"),
    "rollout-min-p": ("rollout", "min_p", float, "min-p"),
    "rollout-max-response-len": ("rollout", "max_response_len", int, "new tokens per turn"),
    "rollout-max-turns": ("rollout", "max_turns", int,
                          "generated turns per trajectory (tool environment when > 1)"),
    "rollout-timeout-seconds": ("rollout", "generate_timeout_s", float, "engine call timeout"),
    "num-digits": ("rollout", "num_digits", int, "digits per prompt of the embedded task"),
    "custom-reward": ("rollout", "custom_reward", str, "module:function replacing the task verifier"),
    "num-values": ("rollout", "num_values", int, "prompt digits are drawn from 0..num-values-1"),
    "lr": ("trainer", "lr", float, "AdamW learning rate"),
    "weight-decay": ("trainer", "weight_decay", float, "AdamW weight decay"),
    "clip-grad": ("trainer", "clip_grad", float, "gradient-norm clip"),
    "eps-clip": ("trainer", "eps_clip", float, "PPO clip low (1 - eps)"),
    "eps-clip-high": ("trainer", "eps_clip_high", float, "PPO clip high (1 + eps)"),
    "tis-cap": ("trainer", "tis_cap", float, "TIS weight cap C"),
    "micro-batch-size": ("trainer", "micro_batch_size", int, "samples per forward/backward"),
    "replay-min-overlap-ratio": ("trainer", "replay_min_overlap_ratio", float,
                                 "fail a step when a token's engine/trainer routing overlap is lower"),
    "replay-max-mismatch-fraction": ("trainer", "replay_max_mismatch_fraction", float,
                                     "fail a step when more tokens than this route differently"),
    "logprobs-chunk-size": ("trainer", "logprobs_chunk_size", int,
                            "fused support-replay logprobs, rows per chunk (0 = from logits)"),
    "rpc-timeout-seconds": ("trainer", "rpc_timeout_s", float, "trainer's actor-call timeout"),
    "trainer-torch-threads": ("trainer", "torch_threads", int, "torch threads of the trainer"),
    "save": (None, "save_dir", str, "checkpoint directory (default <output-dir>/checkpoints)"),
    "save-interval": (None, "save_interval", int, "checkpoint every N steps (0 = never)"),
    "load": (None, "load", str, "resume from this checkpoint directory"),
    "rs-mode": ("trainer", "rs_mode", str, "RS gate: none | token | sequence | geometric"),
    "rs-lower": ("trainer", "rs_lower", float, "RS lower ratio bound"),
    "rs-upper": ("trainer", "rs_upper", float, "RS upper ratio bound"),
    "rs-denominator": ("trainer", "rs_denominator", str, "loss_tokens | accepted_tokens"),
    "rs-refill-max-rounds": ("trainer", "rs_refill_max_rounds", int, "replacement rounds per step"),
    "rs-refill-max-candidate-cache-bytes": ("trainer", "rs_refill_max_candidate_cache_bytes", int,
                                            "proximal-logprob cache byte cap"),
    "rs-refill-rpc-timeout-seconds": ("trainer", "rs_refill_rpc_timeout_s", float,
                                      "timeout of every refill-path actor call"),
    "dp-size": ("trainer", "dp_size", int, "data-parallel size (refill quantum)"),
    "vpp-size": ("trainer", "vpp_size", int, "virtual pipeline size (refill quantum)"),
    "microbatch-group-size": ("trainer", "microbatch_group_size", int, "VPP microbatch group"),
    "rollout-engine": (None, "rollout_engine", str, "rollout engine (registry name): embedded"),
}
_BOOL_FLAGS: dict[str, tuple[str | None, str, str]] = {
    "use-routing-replay": ("trainer", "use_routing_replay", "R3: replay the engine's MoE routing"),
    "use-indexer-replay": ("trainer", "use_indexer_replay", "replay the indexer's top-k keys"),
    "use-support-replay": ("trainer", "use_support_replay", "logprobs over the sampler's support"),
    "grpo-std-normalization": ("trainer", "normalize_advantage_std", "divide advantages by group std"),
    "rs-batch-refill": ("trainer", "rs_batch_refill", "exact refill of rejected prompt groups"),
    "use-packing": ("trainer", "use_packing", "pack each microbatch into one row (block-diagonal attention)"),
    "progress": (None, "progress", "live progress display"),
}


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Add every run flag (defaults suppressed, so only given flags override the config file)."""
    parser.add_argument("--config", type=Path, help="TOML or JSON file with the same keys as the flags")
    defaults = RunConfig().to_dict()

    def default(section: str | None, name: str) -> Any:
        return defaults[name] if section is None else defaults[
            "rollout" if section == "both" else section][name]

    for flag, (section, name, typ, help_) in _FLAGS.items():
        parser.add_argument(f"--{flag}", type=typ, default=argparse.SUPPRESS,
                            help=f"{help_} (default: {default(section, name)!r})")
    parser.add_argument("--metrics-hook", dest="metrics_hook", action="append",
                        default=argparse.SUPPRESS, metavar="MODULE:FUNCTION",
                        help="call FUNCTION(config, metrics) after each step (repeatable)")
    for flag, (section, name, help_) in _BOOL_FLAGS.items():
        parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS,
                            help=f"{help_} (default: {'on' if default(section, name) else 'off'})")


def _read_file(path: Path) -> dict[str, Any]:
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
    for raw, value in data.items():
        key = raw.replace("_", "-")
        if key in values:
            raise ConfigError(f"--config {path}: --{key} is given twice (as dashes and underscores)")
        if key not in _FLAGS and key not in _BOOL_FLAGS and key != "metrics-hook":
            raise ConfigError(f"--config {path}: unknown key {raw!r} (no flag --{key})")
        values[key] = _typed(key, value, path)
    return values


def _typed(key: str, value: Any, path: Path) -> Any:
    """A config-file value checked against its flag's type (argparse does this for flags)."""
    if key in _BOOL_FLAGS:
        ok = isinstance(value, bool)
    elif key == "metrics-hook":
        return value  # checked in build_config
    elif key in _FLAGS:
        typ = _FLAGS[key][2]
        ok = (isinstance(value, typ) and not isinstance(value, bool)) or (
            typ is float and isinstance(value, int) and not isinstance(value, bool))
        value = float(value) if ok and typ is float else value
    else:
        return value  # build_config names unknown keys
    if not ok:
        expected = "true/false" if key in _BOOL_FLAGS else _FLAGS[key][2].__name__
        raise ConfigError(f"--config {path}: --{key} must be {expected}, got {value!r}")
    return value


def build_config(values: dict[str, Any]) -> RunConfig:
    """A :class:`RunConfig` from flag-name -> value (dashes), over the defaults.

    Raises:
        ConfigError: unknown key, or a value any section rejects (its message names the flag).
    """
    sections: dict[str | None, dict[str, Any]] = {None: {}, "rollout": {}, "trainer": {}}
    for key, value in values.items():
        if key == "metrics-hook":
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ConfigError("--metrics-hook must be a list of module:function strings")
            sections[None]["metrics_hooks"] = tuple(value)
            continue
        if key in _FLAGS:
            section, name = _FLAGS[key][0], _FLAGS[key][1]
        elif key in _BOOL_FLAGS:
            section, name = _BOOL_FLAGS[key][0], _BOOL_FLAGS[key][1]
        else:
            raise ConfigError(f"unknown config key --{key}")
        for target in (("rollout", "trainer") if section == "both" else (section,)):
            sections[target][name] = value
    try:
        rollout = RolloutConfig(**sections["rollout"])
        trainer = TrainerConfig(**sections["trainer"])
        return RunConfig(rollout=rollout, trainer=trainer, **sections[None])
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Merge ``--config`` file values and the flags given on the command line."""
    values = _read_file(args.config) if getattr(args, "config", None) else {}
    if getattr(args, "metrics_hook", None):
        values["metrics-hook"] = list(args.metrics_hook)
    known = set(_FLAGS) | set(_BOOL_FLAGS)
    values.update({k.replace("_", "-"): v for k, v in vars(args).items()
                   if k.replace("_", "-") in known})
    return build_config(values)
