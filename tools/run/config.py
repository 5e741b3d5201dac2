"""The run's settings: :class:`RunConfig` (run level) with the two sides' configs,
:class:`replayrl.rollout.config.RolloutConfig` and :class:`replayrl.trainer.config.TrainerConfig`,
and the checks of the whole run, made before anything starts.

A setting's flag name, default, help and range are declared once, on its field, with
:func:`replayrl.actors.settings.setting`; :mod:`replayrl.tools.run.flags` builds the argparse
flags, the config-file keys and the flag table of docs/configuration.md from them. Adding a
setting is one line in one dataclass, e.g. ``backend: str = setting("fsdp", "train-backend",
"trainer backend", Choices(("fsdp", "megatron")))``.

Each component the run picks checks the settings it cannot serve, in its own room: the engine
(:mod:`replayrl.rollout.engines.run_checks`), the LoRA targets
(:mod:`replayrl.trainer.lora.run_check`), the backend (:mod:`replayrl.trainer.backends.run_checks`)
and the family room (:mod:`replayrl.rollout.model.families.run_check`); :class:`RunConfig` keeps
the rules of the run as a whole (context length, ranks, evaluation, colocation, the task,
keys, resume).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from replayrl.actors.device import DEVICES
from replayrl.actors.settings import Choices, Range, Rule, check_settings, setting
from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.dispatch.engine_pool import ENGINE_FAILURE_POLICIES
from replayrl.rollout.engines.precision import DTYPES
from replayrl.rollout.engines.run_checks import check_run as check_engine_run
from replayrl.rollout.engines.sglang_protocol import parse_urls
from replayrl.rollout.errors import RolloutConfigError
from replayrl.rollout.model.config import MODEL_SIZES, ModelConfig, embedded_config, without_indexer
from replayrl.rollout.model.errors import ModelConfigError, ModelError
from replayrl.rollout.model.families import FAMILIES
from replayrl.rollout.model.families.run_check import check_run as check_family_run
from replayrl.rollout.model.hf_config import read_hf_config
from replayrl.rollout.tasks import (
    TaskConfigError,
    load_environment_class,
    make_task,
    task_name,
)
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.rollout.tasks.sort import prompt_tokens
from replayrl.rollout.weight_sync import WEIGHT_SYNC_CHOICES
from replayrl.rollout.weight_sync.run_check import check_run as check_weight_sync_run
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.checkpoint_dirs import RUN_STATE_FILE, latest_checkpoint
from replayrl.trainer.backends.run_checks import check_run as check_backend_run
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import TrainerConfigError
from replayrl.trainer.lora.run_check import check_run as check_lora_run
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
        device: ``auto``, ``cpu`` or ``cuda`` (``--device``; :mod:`replayrl.actors.device`): the
            embedded engines' and the trainer's device (the trainer's field of the same flag;
            vLLM and SGLang place themselves). ``auto`` and ``cuda`` are resolved, and ``cuda``
            without CUDA refused, in the launcher's initial-files child
            (:func:`replayrl.tools.run.launcher.write_initial_files`); each actor process then
            takes its own CUDA device (:func:`replayrl.actors.device.process_device`).
        output_dir: where metrics.jsonl, the plot and the checkpoint go (``--output-dir``).
        transport: ``ipc`` (one node) or ``tcp`` (loopback) (``--transport``).
        curve_keys: the run's CURVE key directory (``--curve-keys``; required by tcp).
        engine_torch_threads: intra-op threads per engine process.
        progress: show the live progress display.
        save_dir: checkpoint directory (``--save``; default ``<output_dir>/checkpoints``).
        save_interval: checkpoint every this many steps (``--save-interval``; 0 = never).
        load: checkpoint directory to resume from (``--load``).
        overwrite: replace the run ``output_dir`` already holds (``--overwrite``; without it
            or a ``--load`` of one of its checkpoints such a directory is refused:
            :mod:`replayrl.tools.run.output_dir`); recorded as false in ``config.json``, so a
            run started again from that record never clears anything unasked.
        metrics_hooks: ``module:function`` loggers called after each step with the frozen
            config and a read-only view of the metrics (``--metrics-hook``, repeatable).
        rollout_engine: the rollout engine's registry name (``--rollout-engine``,
            ``replayrl.rollout.engines.ENGINES``); the launcher rejects an unknown one.
        hf_checkpoint: the initial policy, a Hugging Face checkpoint directory of a
            ``model_type`` the embedded model reads (qwen3, qwen3_moe) or of a model family
            (``replayrl.rollout.model.families.FAMILIES``) (``--hf-checkpoint``); ``""`` = the
            embedded default built from ``--seed`` (docs/design/model.md#hf-checkpoints).
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
        actor_start_timeout_s: seconds every actor process may take from its start to its
            first answer (imports, the policy built or loaded) before the run fails naming it
            and printing its stacks (``--actor-start-timeout-seconds``); a vLLM or SGLang
            engine gets ``engine_start_timeout_s`` on top
            (:func:`replayrl.tools.run.launcher.ready_timeouts`).
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
        weight_sync: how a weight push reaches the engines (``--weight-sync``, a name of
            :data:`replayrl.rollout.weight_sync.WEIGHT_SYNCS` or ``auto``, resolved by
            :func:`replayrl.rollout.weight_sync.run_check.resolve`; its refusals are the room's,
            :func:`replayrl.rollout.weight_sync.run_check.check_run`).
        weight_sync_dir: the directory ``--weight-sync disk`` writes pushes to
            (``--weight-sync-dir``; ``""`` = ``<output-dir>/weight-sync``).
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
    device: str = setting("auto", "device", "where the embedded engine and the torch / fsdp "
                          "trainer compute: auto = CUDA where torch sees a device, else the CPU; "
                          "cuda without one is refused before start; on a CUDA device with bf16 "
                          "the trainer computes in bf16 over fp32 master weights (docs/gpu.md)",
                          Choices(DEVICES))
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
    overwrite: bool = setting(False, "overwrite", "replace the run already in --output-dir: "
                              "remove its metrics, plot and checkpoints first (without it, or "
                              "a --load of one of its checkpoints, such a directory is refused)")
    metrics_hooks: tuple[str, ...] = setting(
        (), "metrics-hook", "logger called after each step with the frozen config and a "
        "read-only view of the metrics", Rule(lambda hooks: all(":" in h for h in hooks),
                                              "module:function"), metavar="MODULE:FUNCTION")
    rollout_engine: str = setting("embedded", "rollout-engine", "rollout engine, a name in the "
                                  "registry replayrl.rollout.engines.ENGINES (checked by the launcher)")
    hf_checkpoint: str = setting("", "hf-checkpoint", "initial policy: a Hugging Face checkpoint "
                                 "directory (safetensors, sharded or not) of model_type qwen3 or "
                                 "qwen3_moe (the embedded model) or of a model family: "
                                 + ", ".join(sorted(FAMILIES)) + " (docs/checkpoints.md)",
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
    actor_start_timeout_s: float = setting(180.0, "actor-start-timeout-seconds",
                                           "seconds an actor process may take to start (imports, "
                                           "the policy built or loaded) before the run fails "
                                           "naming it; a vllm or sglang engine gets "
                                           "--engine-start-timeout-seconds more",
                                           Range(low=0, closed="(]"))
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
    weight_sync: str = setting("auto", "weight-sync", "how a weight push reaches the engines: "
                               "zmq (ZeroMQ frames), shm (the shared-memory pool, ipc engines), "
                               "disk (safetensors in --weight-sync-dir), dist (bucketed "
                               "broadcasts over a torch.distributed group: gloo on CPU, NCCL on "
                               "CUDA), ipc (CUDA IPC handles, one GPU); auto = shm where the "
                               "engines are ipc peers and the pool is on, else zmq",
                               Choices(WEIGHT_SYNC_CHOICES))
    weight_sync_dir: str = setting("", "weight-sync-dir", "where --weight-sync disk writes each "
                                   "push; the same path on every engine's host", metavar="DIR",
                                   default_text="<output-dir>/weight-sync")
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
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self._check_components()
        if self.eval_interval and not self.rollout.eval_prompt_data:
            raise ConfigError("--eval-interval needs at least one --eval-prompt-data NAME FILE")
        if self.rollout.eval_prompt_data and not self.eval_interval:
            raise ConfigError("--eval-prompt-data is evaluated every --eval-interval N steps "
                              "(and after the last); give --eval-interval")
        names = [n for n, _ in self.rollout.eval_sets()]
        if len(set(names)) != len(names):
            raise ConfigError(f"--eval-prompt-data names must differ, got {names}")
        if problems := self.colocate_problems():  # every conflict at once, one per line
            raise ConfigError("\n".join(problems))
        self._check_task()
        if self.transport == "tcp" or self.curve_keys:
            self._check_keys()
        if self.load:
            self._check_checkpoint()
        if not self.save_dir:
            object.__setattr__(self, "save_dir", str(Path(self.output_dir) / "checkpoints"))

    def _check_components(self) -> None:
        """Each component the run picks checks the settings it cannot serve, in its own room
        (light modules: the launcher loads no torch): the engine (``--rollout-engine``, LoRA,
        a family policy, the SGLang servers), the weight sync (``--weight-sync``), the LoRA targets, the backend
        (``--train-backend``, a family policy, the megatron layout) and the family room.

        Raises:
            ConfigError: the first refusal, with the component's message.
        """
        try:
            check_engine_run(self)
            check_weight_sync_run(self)
            check_lora_run(self)
            check_backend_run(self)
            check_family_run(self)
        except (RolloutConfigError, ModelConfigError, TrainerConfigError) as exc:
            raise ConfigError(str(exc)) from None

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
                loaded or that would never act (``--rollout-max-turns 1``; tools without
                ``--apply-chat-template``), or
                ``--rollout-max-turns > 1`` with neither ``--env`` nor a task environment
                (names the flags).
        """
        r = self.rollout
        name = task_name(r)
        try:
            task = make_task(r)
        except TaskConfigError as exc:
            raise ConfigError(f"--task {name}: {exc}") from None
        if r.env:
            try:
                env_class = load_environment_class(r.env)
            except TaskConfigError as exc:
                raise ConfigError(str(exc)) from None
            tools = [t.get("function", t).get("name", "?") for t in getattr(env_class, "tools", ())]
            if tools and not r.apply_chat_template:  # the schema is rendered only by the template
                raise ConfigError(f"--env {r.env} offers tools ({', '.join(tools)}) that reach "
                                  f"the policy only through the chat template: add "
                                  f"--apply-chat-template (with a tokenizer whose chat template "
                                  f"renders tools); without it the environment never acts")
            if r.max_turns == 1:  # the environment answers between turns: one turn has none
                raise ConfigError(f"--env {r.env} acts between turns, but --rollout-max-turns 1 "
                                  f"leaves none: the environment would never act; give "
                                  f"--rollout-max-turns 2 or more (a tool call and its answer "
                                  f"take two)")
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
        path = Path(self.load) / RUN_STATE_FILE
        try:
            state = strict_json.loads(path.read_text())
            next_step = int(state["next_step"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--load {self.load}: not a readable replayrl checkpoint "
                              f"({path}: {type(exc).__name__}: {exc}){_load_hint(Path(self.load))}") from None
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
        record["overwrite"] = False  # an instruction to this start, not a setting to repeat
        return strict_json.dumps(absent_as_null(record), indent=1) + "\n"


def _load_hint(directory: Path) -> str:
    """What a ``--load`` that is no replayrl checkpoint may have meant: a Hugging Face model
    directory (``--hf-checkpoint``), or the ``--save`` folder above its ``step-N`` checkpoints;
    empty when neither fits."""
    if (directory / "config.json").is_file() and not (directory / "trainer_state.pt").exists():
        return "; a Hugging Face model directory starts a run with --hf-checkpoint"
    latest = latest_checkpoint(directory)
    if latest is not None:
        return f"; its checkpoints are the step-N folders inside, e.g. --load {latest}"
    return ""
