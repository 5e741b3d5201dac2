"""Single-node multi-process launcher: one process per actor, all talking over ZeroMQ.

Processes: ``version_clock``, ``rollout_manager``, ``engine_0..``, ``trainer`` and, with
``--dp-size N > 1``, the trainer ranks ``trainer_1 .. trainer_{N-1}``; this process drives the
loop. With ``--colocate`` the clock, the manager, ``engine_0`` and the trainer share one process
(:data:`COLOCATED`, docs/design/actors.md#colocate). A lost engine (exited, or silent past
``--heartbeat-deadline-s``) is dropped or restarted and its prompt groups regenerated under
``--engine-failure`` (docs/design/engine-faults.md#engine-faults); any other actor that dies ends the run at
once with its traceback; Ctrl-C (or any error here) stops every actor; the run's ipc
directory is removed in every case. While the actors serve, ``<output-dir>/attach.json``
tells ``replayrl repl --attach`` where they are (:mod:`replayrl.tools.run.attach_card`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from replayrl.actors import DRIVER, ActorSpec, Directory, DriverActors, Supervisor, import_callable
from replayrl.actors.device import cuda_absent_reason, cuda_slots, resolve_device_kind
from replayrl.actors.errors import ActorDied, DeviceError, VersionError
from replayrl.actors.run_dir import create_run_dir
from replayrl.actors.version_clock import VersionRules
from replayrl.rollout.dispatch.prefetched import read_prefetched
from replayrl.rollout.engines import EngineError, check_capture, engine_class_path, load_engine_class
from replayrl.rollout.engines.precision import resolve_dtype
from replayrl.rollout.engines.sglang_protocol import parse_urls
from replayrl.rollout.errors import PromptDataError, RewardError, RolloutConfigError, RolloutError, TokenizerError
from replayrl.rollout.model.config import default_config
from replayrl.rollout.model.errors import ModelError
from replayrl.rollout.model.weight_files import check_weight_files, weight_shapes
from replayrl.rollout.model.word_tokenizer import save_word_tokenizer
from replayrl.rollout.sample import required_traces
from replayrl.rollout.scoring.rewards import load_math_verify
from replayrl.rollout.tasks import Task, load_environment_class, load_task_class, task_class_path, task_name
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.rollout.text.prompt_data import load_run_prompts
from replayrl.rollout.text.tokenizer import load_tokenizer
from replayrl.rollout.text.tokenizer_class import AUTO, resolve_tokenizer
from replayrl.rollout.traces import trace_table
from replayrl.rollout.weight_sync.run_check import check_device as check_sync_device
from replayrl.rollout.weight_sync.run_check import resolve as resolve_sync
from replayrl.rollout.weight_sync.run_check import trainer_spec as weight_sync_spec
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.attach_card import remove_attach_card, write_attach_card
from replayrl.tools.run.checkpoint_dirs import RUN_STATE_FILE
from replayrl.tools.run.colocated_loss import explain_colocated_loss
from replayrl.tools.run.config import RunConfig
from replayrl.tools.run.extras_check import check_extras
from replayrl.tools.run.initial_files import Resolved, in_child
from replayrl.tools.run.metrics import MetricsRecorder
from replayrl.tools.run.output_dir import check_output_dir, clear_run
from replayrl.tools.run.train_loop import checkpoint_next_step, train_loop
from replayrl.trainer.backends import resolve_backend
from replayrl.trainer.ranks.rank_group import follower_names
from replayrl.transport import strict_json


@dataclass(frozen=True)
class RunResult:
    """What a finished run produced: the summary line and the files written."""

    summary: str
    metrics_path: Path
    plot_path: Path
    rows: list


def load_hook(path: str, flag: str):
    """The function named ``module:function`` given to ``flag``.

    Raises:
        ConfigError: not importable or not callable (names the flag).
    """
    try:
        return import_callable(path, flag)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_writable(directory: Path, flag: str) -> None:
    """Raise :class:`ConfigError` unless ``directory`` can be created and written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".replayrl-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{flag} {directory}: not writable: {exc}") from None


def check_load(config: RunConfig) -> int:
    """Read and check every file of the ``--load`` checkpoint (model, trainer state, clock
    state, the prefetched rollout a resumed asynchronous run trains) before any actor starts,
    so a truncated checkpoint, another backend's or one saved under another parallel layout
    (docs/design/megatron.md#megatron-backend) fails in seconds, not after the actors have
    started; returns its trainer version.

    Raises:
        ConfigError: a missing, truncated or malformed file (names the flag and the file), or
            a checkpoint that does not fit ``--train-backend`` and the layout flags.
    """
    path = Path(config.load)
    try:
        version = resolve_backend(config.trainer.train_backend).check_checkpoint(path, config.trainer)
        state = strict_json.loads((path / RUN_STATE_FILE).read_text())
        clock = VersionRules.from_state_dict(state["clock"])
        prefetched = state["manager"].get("prefetched")
        if prefetched and config.max_staleness > 0:  # the resumed run trains it as it was
            read_prefetched(path / prefetched["file"])
    except (ModelError, VersionError, RolloutError, ValueError, OSError, KeyError, TypeError) as exc:
        raise ConfigError(f"--load {path}: {type(exc).__name__}: {exc}") from None
    if clock.trainer_version != version:
        raise ConfigError(f"--load {path}: the clock is at version {clock.trainer_version}, the "
                          f"trainer state at {version}; the checkpoint is inconsistent")
    if not config.hf_checkpoint:
        check_load_fits_policy(path, config)
    return version


def check_load_fits_policy(path: Path, config: RunConfig) -> None:
    """Refuse a ``--load`` checkpoint whose weights (``path/model``, safetensors headers only)
    are not the embedded policy this run's flags build (its tensors' names and shapes, built on
    torch's meta device: no memory, no initialisation): a checkpoint of another
    ``--model-size``, or saved with the other ``--model-indexer`` setting, fails here rather
    than in the trainer once every actor has started. An ``--hf-checkpoint`` run's policy is
    checked by the trainer's load (the saved names may differ from the checkpoint's own: tied
    or converted weights), and so is a checkpoint whose backend saved no safetensors model.

    Raises:
        ConfigError: names ``--load``, the first missing, unexpected or reshaped tensor, and
            the flags to resume with.
    """
    import torch

    from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM

    try:
        saved = weight_shapes(path / "model")
    except ModelError:  # no safetensors model in this backend's checkpoint: the trainer checks it
        return
    with torch.device("meta"):
        policy = {name: tuple(t.shape) for name, t in
                  Qwen3MoeForCausalLM(config.policy_config).state_dict().items()}
    missing, unexpected = sorted(set(policy) - set(saved)), sorted(set(saved) - set(policy))
    reshaped = [name for name in sorted(set(policy) & set(saved)) if policy[name] != saved[name]]
    if missing:
        what = f"it lacks {missing[0]!r} ({len(missing)} tensor(s) of this run's policy)"
    elif unexpected:
        what = f"it holds {unexpected[0]!r} ({len(unexpected)} tensor(s) this run's policy has not)"
    elif reshaped:
        what = f"{reshaped[0]!r} is {list(saved[reshaped[0]])}, this run's {list(policy[reshaped[0]])}"
    else:
        return
    raise ConfigError(f"--load {path}: the checkpoint's model is not this run's policy: {what}; "
                      f"resume with the model flags of the run that saved it (--model-size, "
                      f"--model-indexer / --no-model-indexer; its config.json records them)")


def write_run_config(config: RunConfig, output: Path) -> Path:
    """Write the run's record ``output/config.json`` (:meth:`replayrl.tools.run.config.RunConfig.to_json`;
    ``--config`` of it gives the settings back), creating ``output``; returns the file's path.
    Both launchers write it (``replayrl train`` and rank 0 under torchrun)."""
    output.mkdir(parents=True, exist_ok=True)
    path = output / "config.json"
    path.write_text(config.to_json())
    return path


def write_initial_checkpoint(config: RunConfig, directory: Path) -> Path:
    """Build the embedded default policy from ``config.trainer.seed`` and save it as an HF dir,
    which the run then loads like any ``--hf-checkpoint`` (docs/design/model.md#hf-checkpoints).
    Imports torch (the launcher itself does it in a child process: :func:`write_initial_files`)."""
    from replayrl.rollout.model.checkpoint import save_pretrained
    from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(config.policy_config)
    model.init_weights(config.trainer.seed)
    save_pretrained(model, directory, tokens=list(VOCABULARY))
    return directory


def write_initial_files(config: RunConfig, engine: str, checkpoint: Path | None,
                        tokenizer: Path, prompts_of: Path | None = None) -> Resolved:
    """Check the engine class ``engine`` (``"module:Class"``), resolve the engine dtype, write
    the embedded default checkpoint to ``checkpoint`` (None: the run has one,
    ``--hf-checkpoint``), then resolve the tokenizer class of ``tokenizer``, and with
    ``prompts_of`` (the run's initial checkpoint directory) check the prompt data
    (:func:`check_prompt_data`) with the tokenizer the resolution loaded: the rollout manager's
    load, not read again. Imports torch: the launcher runs it in a child process
    (:mod:`replayrl.tools.run.initial_files`).

    Returns:
        :class:`Resolved`; its ``tokenizer_class`` is ``"auto"`` when the directory does not load
        here (the prompt check's own load then reports the error, with the flag).

    Raises:
        replayrl.tools.errors.ConfigError: as :func:`check_engine` and :func:`check_prompt_data`;
            ``--weight-sync ipc`` where ``--device`` resolves to the CPU or to several CUDA
            devices.
    """
    check_engine(config, engine)
    device, cuda_devices = resolve_run_device(config)
    try:  # --weight-sync ipc on what --device auto resolved to
        check_sync_device(resolve_sync(config), device, cuda_devices)
    except RolloutConfigError as exc:
        raise ConfigError(str(exc)) from None
    dtype = resolve_dtype(config.engine_dtype, device)
    if checkpoint is not None:
        write_initial_checkpoint(config, checkpoint)
    try:
        tokenizer_class, loaded = resolve_tokenizer(tokenizer)
    except Exception:  # reported, with the flag, by check_prompt_data's load
        tokenizer_class, loaded = AUTO, None
    if prompts_of is not None:
        check_prompt_data(config, prompts_of, tokenizer_class, loaded)
    return Resolved(engine, dtype, tokenizer_class, device, cuda_devices)


def resolve_run_device(config: RunConfig) -> tuple[str, int]:
    """``--device`` resolved on this machine (:func:`replayrl.actors.device.resolve_device_kind`):
    ``("cpu", 0)`` or ``("cuda", visible CUDA devices)``. Imports torch (the launcher calls it in
    its initial-files child).

    Raises:
        ConfigError: ``--device cuda`` where torch sees no CUDA device (says why: a CPU-only
            torch build, or no device visible).
    """
    import torch

    try:
        kind = resolve_device_kind(config.device, torch.cuda.is_available(), cuda_absent_reason())
    except DeviceError as exc:
        raise ConfigError(str(exc)) from None
    return kind, torch.cuda.device_count() if kind == "cuda" else 0


def initial_checkpoint(config: RunConfig, output: Path) -> Path:
    """The checkpoint directory the run starts from: ``--hf-checkpoint``, or the embedded
    default written to ``output/checkpoint-init``. Engines and trainer read the policy from it
    through the same loader (``replayrl.rollout.model.loader``) either way."""
    if config.hf_checkpoint:
        return Path(config.hf_checkpoint)
    return write_initial_checkpoint(config, output / "checkpoint-init")


def resolved_initial_checkpoint(config: RunConfig, output: Path) -> tuple[Path, Resolved]:
    """:func:`initial_checkpoint` with its torch work (and the engine check, its dtype and the
    tokenizer class: :func:`write_initial_files`) in a child process; returns the checkpoint
    directory and what :func:`actor_specs` takes as ``resolved`` (the REPL's own run).

    Raises:
        ConfigError: as :func:`engine_path` and :func:`check_engine`.
    """
    checkpoint = Path(config.hf_checkpoint) if config.hf_checkpoint else output / "checkpoint-init"
    resolved = in_child(write_initial_files, config, engine_path(config),
                        None if config.hf_checkpoint else checkpoint, tokenizer_dir(config, checkpoint))
    return checkpoint, resolved


def _checked_initial_checkpoint(config: RunConfig, output: Path, engine: str) -> tuple[Path, Resolved]:
    """:func:`initial_checkpoint` and :func:`check_prompt_data` such that a configuration
    error changes nothing in ``output``: the embedded default is written to
    ``output/.checkpoint-init.partial`` and renamed to ``checkpoint-init`` only once the prompt
    data passed (an earlier run's checkpoint there stays until then). The engine class
    ``engine`` is checked (:func:`check_engine`), its dtype and the tokenizer class resolved,
    the checkpoint written and the prompt data checked in a child process
    (:func:`write_initial_files`): this process loads no torch and reads no tokenizer.

    Returns:
        (the initial checkpoint directory, what :func:`actor_specs` takes as ``resolved``).

    Raises:
        ConfigError: as :func:`check_engine` and :func:`check_prompt_data`.
    """
    staged = output / ".checkpoint-init.partial"
    shutil.rmtree(staged, ignore_errors=True)  # left by a launcher killed here
    try:
        checkpoint = Path(config.hf_checkpoint) if config.hf_checkpoint else staged
        if config.hf_checkpoint and not config.rollout.tokenizer and not config.rollout.prompt_data:
            write_embedded_tokenizer(tokenizer_dir(config, checkpoint))
        resolved = in_child(write_initial_files, config, engine, None if config.hf_checkpoint else staged,
                            tokenizer_dir(config, checkpoint), checkpoint)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if config.hf_checkpoint:
        return checkpoint, resolved
    final = output / "checkpoint-init"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staged, final)
    return final, resolved


def run_required_traces(config: RunConfig) -> list[str]:
    """The traces every trajectory of this run must carry and the engines capture
    (:func:`replayrl.rollout.sample.required_traces` of the embedded policy and the replay flags)."""
    t = config.trainer
    return list(required_traces(config.policy_config,
                                **{f"{row.replay}_replay": getattr(t, row.setting)
                                   for row in trace_table.TRACES}))


def resolve_engine(config: RunConfig) -> str:
    """The ``"module:Class"`` of the run's rollout engine, checked against the required traces
    (:func:`engine_path`, then :func:`check_engine`, which imports the engine class).

    Raises:
        ConfigError: as :func:`engine_path` and :func:`check_engine`.
    """
    path = engine_path(config)
    check_engine(config, path)
    return path


def engine_path(config: RunConfig) -> str:
    """The ``"module:Class"`` registered for ``--rollout-engine`` in
    ``replayrl.rollout.engines.ENGINES`` of this process (a test may register a fake engine
    there before launching); imports nothing.

    Raises:
        ConfigError: ``--rollout-engine`` names no registered engine (the message lists the
            known ones).
    """
    try:
        return engine_class_path(config.rollout_engine)
    except EngineError as exc:
        raise ConfigError(f"--rollout-engine {config.rollout_engine}: {exc}") from None


def check_engine(config: RunConfig, path: str) -> None:
    """Import the engine class ``path`` (not its heavy dependencies at registry load) and check
    that it captures every required trace and can serve the policy. The launcher runs it in its
    initial-files child (:mod:`replayrl.tools.run.initial_files`): the embedded engine imports torch.

    Raises:
        ConfigError: the class does not import, it cannot capture a required trace (names the
            engine and the trace) or it cannot serve the policy (e.g. vLLM and the indexer).
    """
    try:
        cls = load_engine_class(path)
        check_capture(cls, run_required_traces(config))
        cls.check_model(config.policy_config)
    except EngineError as exc:
        raise ConfigError(f"--rollout-engine {config.rollout_engine}: {exc}") from None


SGLANG_RETRIES = 2
"""Resends of one SGLang request after a server did not answer (docs/design/engines.md#sglang-engine)."""


def engine_kwargs(config: RunConfig, index: int = 0, dtype: str | None = None,
                  device: str | None = None) -> dict:
    """Constructor kwargs of the run's engine (plain data; they cross to the engine process).

    Every engine gets the policy's shape and precision: ``model_config`` (``ModelConfig``
    fields, HF names) and ``dtype`` (``--engine-dtype``, with ``auto`` resolved here for the
    device the engines run on: :func:`replayrl.rollout.engines.precision.resolve_dtype`). The
    embedded engine also gets ``device``: ``--device`` resolved (``"cpu"`` / ``"cuda"``, the
    launcher's initial-files child), or as given when None (its process resolves it:
    :func:`replayrl.actors.device.process_device`). The vLLM engine
    also gets its start-up timeout (``--engine-start-timeout-seconds``) and per-call timeout
    (``--rollout-timeout-seconds``, the one the manager waits an engine call for). The SGLang
    engine ``index`` gets ``--sglang-urls`` rotated to start at URL ``index`` (its server; the
    others are its failover order), the weight directory, and a per-request timeout that lets its
    ``1 + SGLANG_RETRIES`` tries fit in the manager's wait. ``dtype``: the engine dtype
    already resolved (the launcher's initial-files child); None: resolved here for ``device``
    (imports torch for ``auto``).

    Raises:
        ConfigError: ``dtype`` is None, ``--engine-dtype auto`` and ``--device cuda`` where
            torch sees no CUDA device (:func:`resolve_run_device`).
    """
    if dtype is None:
        dtype = resolve_dtype(config.engine_dtype, device or (
            resolve_run_device(config)[0] if config.engine_dtype == "auto" else "cpu"))
    kwargs = {"model_config": dataclasses.asdict(config.policy_config), "dtype": dtype}
    if config.rollout_engine == "embedded":
        kwargs["device"] = device or config.device
    if config.rollout_engine == "vllm":
        kwargs.update(start_timeout_s=config.engine_start_timeout_s,
                      call_timeout_s=config.rollout.generate_timeout_s)
    if config.rollout_engine == "sglang":
        urls = list(parse_urls(config.sglang_urls))
        kwargs.update(urls=urls[index:] + urls[:index], weight_dir=config.sglang_weight_dir,
                      start_timeout_s=config.engine_start_timeout_s, retries=SGLANG_RETRIES,
                      call_timeout_s=config.rollout.generate_timeout_s / (1 + SGLANG_RETRIES))
    return kwargs


def split_cpus(allowed: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``--cpu-affinity split``: (the trainer's CPUs, every other actor's CPUs).

    The trainer gets the first half of ``allowed`` (sorted; at least one CPU), the rest go to
    the engines, the rollout manager and the clock. Under the one-step overlap the trainer is
    the side the step waits for, and time-sharing its core with the rollout side's bursts
    delays every step. With fewer than two CPUs there is nothing to split: both are ``()``
    (inherit).
    """
    cpus = sorted(set(allowed))
    if len(cpus) < 2:
        return (), ()
    half = len(cpus) // 2
    return tuple(cpus[:half]), tuple(cpus[half:])
def tokenizer_dir(config: RunConfig, checkpoint_dir: Path) -> Path:
    """The directory the run's tokenizer is read from: ``--tokenizer``; else, for a run from
    ``--hf-checkpoint`` on the built-in task (no ``--prompt-data``), ``<output-dir>/tokenizer-init``
    (the built-in prompts are words of the embedded vocabulary: :func:`write_embedded_tokenizer`);
    else the initial checkpoint (the user's checkpoint, or the embedded default with its
    word-level tokenizer)."""
    if config.rollout.tokenizer:
        return Path(config.rollout.tokenizer)
    if config.hf_checkpoint and not config.rollout.prompt_data:
        return Path(config.output_dir) / "tokenizer-init"
    return Path(checkpoint_dir)


def write_embedded_tokenizer(directory: Path) -> Path:
    """The embedded word-level tokenizer alone (no model) in ``directory``; returns it."""
    save_word_tokenizer(directory, list(VOCABULARY), default_config(len(VOCABULARY)).max_position_embeddings)
    return directory


def check_prompt_data(config: RunConfig, checkpoint_dir: Path, tokenizer_class: str | None = None,
                      tokenizer_object: Any = None) -> None:
    """Read the tokenizer (with ``tokenizer_class``, or take ``tokenizer_object``, its load: see
    :func:`replayrl.rollout.text.tokenizer.load_tokenizer`) and every prompt set, before any actor
    process starts.

    Raises:
        ConfigError: ``--rollout-max-response-len`` or ``--eval-max-response-len`` at or past
            the policy's positions, the tokenizer cannot be loaded or has more ids than the
            policy's vocabulary, a prompt row is bad (names file, line and key), ``--rm-type math``
            without math-verify, or ``--num-steps`` x ``--rollout-batch-size`` needs more
            prompts than ``--num-epoch`` passes hold.
    """
    r = config.rollout
    model = config.policy_config
    positions = model.max_position_embeddings
    for flag, length in (("--rollout-max-response-len", r.max_response_len),
                         ("--eval-max-response-len", r.eval_max_response_len)):
        if length >= positions:  # every prompt would be refused, as if the file were at fault
            raise ConfigError(f"{flag} {length} leaves no room for a prompt in the policy's "
                              f"{positions} positions (max_position_embeddings); give at most "
                              f"{positions - 1}, less each prompt's length")
    try:
        tokenizer = load_tokenizer(tokenizer_dir(config, checkpoint_dir),
                                   apply_chat_template=r.apply_chat_template,
                                   chat_template_kwargs=json.loads(r.apply_chat_template_kwargs),
                                   # prompts render the --env environment's tool schema
                                   tools=load_environment_class(r.env).tools if r.env else (),
                                   tokenizer_class=tokenizer_class, tokenizer_object=tokenizer_object)
        if tokenizer.vocab_size > model.vocab_size:
            raise ConfigError(f"--tokenizer {tokenizer.directory}: {tokenizer.vocab_size} ids, "
                              f"more than the policy's vocabulary of {model.vocab_size}")
        try:
            prompts = load_run_prompts(r, tokenizer, vocab_size=model.vocab_size,
                                       max_positions=model.max_position_embeddings)
        except PromptDataError as exc:
            raise _word_tokenizer_error(config, exc) from None
        if r.rm_type == "math" and not r.custom_reward:
            load_math_verify()
    except (TokenizerError, PromptDataError, RewardError) as exc:
        raise ConfigError(str(exc)) from None
    own_reward = load_task_class(task_class_path(task_name(r))).reward is not Task.reward
    if r.rm_type == "digits" and not r.custom_reward and not own_reward:
        # the digits reward compares token ids: a text label would fail at the first reward
        # (a task with its own reward, e.g. sort, does not score with --rm-type)
        for name, rows in (("--prompt-data", prompts.train), *prompts.evals):
            bad = next((p for p in rows if p.answer_id < 0), None)
            if bad is not None:
                raise ConfigError(
                    f"--rm-type digits needs labels that are one vocabulary token (an answer "
                    f"digit), but {bad.source or f'{name} row {bad.index}'} has the label "
                    f"{bad.label!r}; use --rm-type exact or math for text answers")
    needed = config.num_steps * r.rollout_batch_size
    if r.num_epoch and needed > r.num_epoch * len(prompts.train):
        raise ConfigError(f"--num-steps {config.num_steps} x --rollout-batch-size "
                          f"{r.rollout_batch_size} = {needed} prompts, but --num-epoch "
                          f"{r.num_epoch} x {len(prompts.train)} prompts of {prompts.name} "
                          f"hold {r.num_epoch * len(prompts.train)}")


def _word_tokenizer_error(config: RunConfig, exc: PromptDataError) -> Exception:
    """``exc``, or for a prompt the embedded model's word-level tokenizer cannot encode (text
    on a run without ``--hf-checkpoint`` / ``--tokenizer``) a :class:`ConfigError` that says
    what to give instead of the tokenizer's own ``Missing [UNK] token``."""
    cause = exc.__cause__
    if config.hf_checkpoint or config.rollout.tokenizer or not isinstance(cause, TokenizerError):
        return exc
    where = str(exc)[:-len(str(cause))]  # "FILE:LINE: key 'prompt': "
    return ConfigError(f"--prompt-data {where}not made of the {len(VOCABULARY)} words the embedded "
                       f"model's tokenizer knows (the digit task's); for text prompts give "
                       f"--hf-checkpoint DIR, a policy with its own tokenizer (or --tokenizer DIR "
                       f"whose ids fit the policy's vocabulary of {config.policy_config.vocab_size})")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listened on a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


DRIVER_ACTORS = ("version_clock", "rollout_manager")
"""The actors the launcher serves in its own process and event loop (``ActorSpec.process`` =
:data:`replayrl.actors.DRIVER`, :class:`replayrl.actors.DriverActors`), unless ``--colocate``
puts them in the colocated process; a torchrun driver (rank 0) serves the same two."""

COLOCATED = "colocated"
"""The process (``ActorSpec.process``) of the actors :func:`colocated_actors` names under
``--colocate``; its title is ``replayrl actor colocated run RUN``."""


def colocated_actors(config: RunConfig) -> tuple[str, ...]:
    """The actors that share the :data:`COLOCATED` process: the version clock, the rollout
    manager, ``engine_0`` and the trainer under ``--colocate``; none without it."""
    return ("version_clock", "engine_0", "rollout_manager", "trainer") if config.colocate else ()


IDLE_SPIN_COUNT = "30000"
"""libgomp's spins before an idle thread sleeps, for :func:`idle_thread_env` (its default: 300000)."""


def idle_thread_env(config: RunConfig) -> dict[str, dict[str, str]]:
    """Per actor name, the environment that keeps its idle torch threads from spinning long.

    Torch's CPU thread pool on Linux is GNU OpenMP's (libgomp), whose idle threads spin at the
    end of every parallel region before they sleep: 300,000 spins by default. A process of more
    than one torch thread that shares the cores with another busy process (the engine beside the
    trainer, the default placement) then burns the other's core at every barrier, and a thread
    that lost its core holds up the whole region. ``GOMP_SPINCOUNT=30000`` (a tenth) is set for
    the trainer processes when ``--trainer-torch-threads`` or ``--trainer-backward-threads`` is
    above 1, and for the engines when ``--engine-torch-threads`` is, unless the processes have
    cores of their own (``--cpu-affinity split``) or share one (``--colocate``), and unless the
    launcher's environment sets ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` (the children inherit
    it: the user's choice). Not spinning at all (``OMP_WAIT_POLICY=PASSIVE``) was as good where
    the ops are large and 1.6x slower in a backward of small ops (10m x 2), where every region
    then waits for its threads to wake. Measured in docs/benchmarks.md#peer-grid. Returns
    ``{actor name: env}`` for the actors that get one, as :func:`actor_specs` names them.
    """
    if config.colocate or config.cpu_affinity == "split" or {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        return {}
    short_spin = {"GOMP_SPINCOUNT": IDLE_SPIN_COUNT}
    t = config.trainer
    out: dict[str, dict[str, str]] = {}
    if max(t.torch_threads, t.backward_threads) > 1:
        out.update({name: short_spin for name in ("trainer", *follower_names(t.rank_count))})
    if config.engine_torch_threads > 1:
        out.update({f"engine_{i}": short_spin for i in range(config.num_engines)})
    return out


def cuda_device_env(config: RunConfig, resolved: Resolved,
                    visible: str | None = None) -> dict[str, dict[str, str]]:
    """Per actor name, the ``CUDA_VISIBLE_DEVICES`` that gives its process one CUDA device of
    this node (:func:`replayrl.actors.device.cuda_slots`: trainer ranks first, then the engines,
    modulo the devices; the colocated actors the trainer's), so each process's own device is
    its ``cuda:0``. Empty on the CPU and with one device (every process uses it).

    Args:
        resolved: what the initial-files child found (``device``, ``cuda_devices``).
        visible: the launcher's own ``CUDA_VISIBLE_DEVICES`` (default: its environment's):
            the ids handed out are its entries, else ``0 .. cuda_devices - 1``.
    """
    if resolved.device != "cuda" or resolved.cuda_devices < 2:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    if len(ids) < resolved.cuda_devices:
        ids = [str(i) for i in range(resolved.cuda_devices)]
    trainers = ["trainer", *follower_names(config.trainer.rank_count)]
    engines = [f"engine_{i}" for i in range(config.num_engines)]
    slots = cuda_slots(trainers, engines, resolved.cuda_devices, shared=colocated_actors(config))
    return {name: {"CUDA_VISIBLE_DEVICES": ids[slot]} for name, slot in slots.items()}


def actor_specs(config: RunConfig, checkpoint_dir: Path,
                rank_port: int | None = None, resolved: Resolved | None = None) -> list[ActorSpec]:
    """The actors of a run, in start order.

    ``resolved``: the engine class, engine dtype, device and tokenizer class the launcher's
    initial-files child worked out (:mod:`replayrl.tools.run.initial_files`); None: the engine
    and its dtype are resolved here, each process resolves ``--device`` itself, and the
    rollout manager reads the tokenizer with ``AutoTokenizer`` (each imports torch). On a
    machine with several CUDA devices each trainer rank and engine process sees one of them
    (:func:`cuda_device_env`).

    With several trainer ranks (``TrainerConfig.rank_count``) the ``trainer`` actor is rank 0 and
    ``trainer_1 ..`` follow it; they meet at ``tcp://127.0.0.1:rank_port`` (a free port when
    None). The version clock and the rollout manager (:data:`DRIVER_ACTORS`) name the process
    :data:`replayrl.actors.DRIVER`: :func:`launch` serves them itself. Under ``--colocate`` the
    actors of :func:`colocated_actors` name one process, :data:`COLOCATED`, instead; with
    ``--colocate-threads`` ``engine_0`` and the trainer serve on threads of their own there
    (``ActorSpec.thread``).

    Raises:
        ConfigError: as :func:`resolve_engine`.
    """
    engine_class = resolved.engine_class if resolved else resolve_engine(config)
    dtype = resolved.engine_dtype if resolved else None
    device = resolved.device if resolved else None
    required = run_required_traces(config)
    model = config.policy_config
    engines = [f"engine_{i}" for i in range(config.num_engines)]
    trainer_cpus, other_cpus = (split_cpus(os.sched_getaffinity(0))
                                if config.cpu_affinity == "split" else ((), ()))
    ranks = config.trainer.rank_count
    group = None
    if ranks > 1:
        group = {"size": ranks, "host": "127.0.0.1",
                 "port": rank_port if rank_port is not None else free_port()}
    vocab_tokens = [] if config.hf_checkpoint else list(VOCABULARY)
    specs = [
        ActorSpec("version_clock", "replayrl.actors.version_clock:VersionClock",
                  {"max_staleness": config.max_staleness}),
        *(ActorSpec(name, "replayrl.rollout.dispatch.engine_actor:EngineActor",
                    {"engine_class": engine_class, "engine_kwargs": engine_kwargs(config, i, dtype, device),
                     "traces": required, "torch_threads": config.engine_torch_threads})
          for i, name in enumerate(engines)),
        ActorSpec("rollout_manager", "replayrl.rollout.dispatch.manager:RolloutManager",
                  {"config": config.rollout.to_dict(), "engines": engines,
                   "require_traces": required,
                   "max_positions": model.max_position_embeddings,
                   "tokenizer_dir": str(tokenizer_dir(config, checkpoint_dir)),
                   "vocab_size": model.vocab_size, "engine_failure": config.engine_failure,
                   "tokenizer_class": resolved.tokenizer_class if resolved else None,
                   # resolved here, so a task registered in this process reaches the manager's
                   "task": task_class_path(task_name(config.rollout))}),
        ActorSpec("trainer", "replayrl.trainer.ranks.trainer_actor:TrainerActor",
                  {"checkpoint_dir": str(checkpoint_dir), "config": config.trainer.to_dict(),
                   "n_samples_per_prompt": config.rollout.n_samples_per_prompt,
                   "rollout_batch_size": config.rollout.rollout_batch_size,
                   # empty: checkpoints carry the --hf-checkpoint's own tokenizer files
                   "vocab_tokens": vocab_tokens, "engines": engines,
                   "engine_failure": config.engine_failure, "ranks": group,
                   "weight_sync": weight_sync_spec(config)}),
        *(ActorSpec(name, "replayrl.trainer.ranks.trainer_rank:TrainerRank",
                    {"checkpoint_dir": str(checkpoint_dir), "config": config.trainer.to_dict(),
                     "vocab_tokens": vocab_tokens, "group": {**group, "rank": rank}})
          for rank, name in enumerate(follower_names(ranks), start=1)),
    ]
    trainers = {"trainer", *follower_names(ranks)}
    colocated = colocated_actors(config)
    threaded = ("engine_0", "trainer") if config.colocate_threads else ()
    idle_env = idle_thread_env(config)
    gpu_env = cuda_device_env(config, resolved) if resolved else {}
    return [dataclasses.replace(spec, cpus=trainer_cpus if spec.name in trainers else other_cpus,
                                env={**spec.env, **idle_env.get(spec.name, {}),
                                     **gpu_env.get(spec.name, {})},
                                process=(COLOCATED if spec.name in colocated else
                                         DRIVER if spec.name in DRIVER_ACTORS else ""),
                                thread=spec.name in colocated and spec.name in threaded)
            for spec in specs]


def ready_timeouts(config: RunConfig, specs: Sequence[ActorSpec]) -> dict[str, float]:
    """Seconds each actor of ``specs`` may take from its process's start to its first answer:
    ``--actor-start-timeout-seconds``; an engine of ``--rollout-engine vllm`` or ``sglang``
    (whose start waits for ``vllm.LLM`` or its server's ``/health`` up to
    ``--engine-start-timeout-seconds``, so that a failed start shows the engine's own error)
    gets that much more."""
    slow = config.rollout_engine in ("vllm", "sglang")
    engines = {f"engine_{i}" for i in range(config.num_engines)}
    return {s.name: config.actor_start_timeout_s
            + (config.engine_start_timeout_s if slow and s.name in engines else 0.0) for s in specs}


def report_start_wait(waiting: list[str], seconds: float, timeout: float) -> None:
    """Print (stderr) which actors a start still waits for: the :class:`Supervisor`'s
    ``on_waiting``, so a slow or stuck start is never silent."""
    others = f" (then {', '.join(waiting[1:])})" if waiting[1:] else ""
    print(f"replayrl: starting: waiting for {waiting[0]}{others}, {seconds:.0f} s of at most "
          f"{timeout:g} s (--actor-start-timeout-seconds)", file=sys.stderr, flush=True)


def start_supervision(config: RunConfig, specs: Sequence[ActorSpec]) -> dict:
    """The :class:`replayrl.actors.Supervisor` arguments of the run's start: each actor's ready
    timeout (:func:`ready_timeouts`), the wait printed while it lasts (:func:`report_start_wait`)
    and the flag that sets it named in a timeout's error."""
    timeouts = ready_timeouts(config, specs)
    return {"ready_timeout": config.actor_start_timeout_s, "ready_timeouts": timeouts,
            "on_waiting": report_start_wait,
            "timeout_hint": "raise --actor-start-timeout-seconds if this machine is that slow"}


ENGINE_LOSS = {"regenerate": "drop", "restart": "replace", "fail": "fail"}
"""``--engine-failure`` -> what the :class:`replayrl.actors.Supervisor` does with a lost engine process."""


def engine_supervision(config: RunConfig, directory: Directory) -> dict:
    """The :class:`replayrl.actors.Supervisor` arguments for the run's engines under
    ``--engine-failure`` (docs/design/engine-faults.md#engine-faults): they are expendable, except an engine
    of the colocated process (``--colocate``: lost with the trainer, it ends the run; while it
    serves, losing every other engine does not);
    a restarted one first loads the trainer's current weights (recorded by the clock), then
    rejoins the rollout manager's pool."""
    async def restored(engine: str) -> None:
        await directory.proxy("trainer").push_weights_to(engine)
        await directory.proxy("rollout_manager").restore_engine(engine)

    colocated = colocated_actors(config)
    engines = [f"engine_{i}" for i in range(config.num_engines)]
    return {"expendable": tuple(e for e in engines if e not in colocated),
            # a colocated engine_0 serves on after the others are lost (its own loss ends the run)
            "kept": tuple(e for e in engines if e in colocated),
            "on_lost": ENGINE_LOSS[config.engine_failure], "on_replaced": restored}


async def launch(config: RunConfig, log_level: int = logging.WARNING,
                 specs: list[ActorSpec] | None = None, started: float | None = None) -> RunResult:
    """Start every actor, run the loop, write metrics / plot, stop everything.

    ``specs`` replaces :func:`actor_specs` (tests inject failing actors this way). ``started``:
    the ``time.perf_counter()`` at which the user's command started (default: now), for the
    summary's seconds with start-up.

    Raises:
        ConfigError: a hook / reward that does not import, an unwritable ``--save`` /
            ``--save-hf``, an unknown / unfit ``--rollout-engine``, unusable prompt data or
            tokenizer (:func:`check_prompt_data`), or a bad ``--load`` checkpoint
            (:func:`check_load`), all before any process starts.
        replayrl.actors.ActorDied: an actor process exited (its traceback is in the message).
        replayrl.actors.RemoteError: an actor method raised (remote traceback in the message).
    """
    started = time.perf_counter() if started is None else started
    # everything that can be checked is checked before any process starts
    output = Path(config.output_dir)
    check_output_dir(config)  # an earlier run there: resume it or replace it, never mix them
    created = not output.exists()  # (--save's check may create it below)
    engine = engine_path(config)  # its class is checked in the initial-files child (torch)
    hooks = [load_hook(h, "--metrics-hook") for h in config.metrics_hooks]
    if config.rollout.custom_reward:
        load_hook(config.rollout.custom_reward, "--custom-reward")
    if config.save_interval:
        check_writable(Path(config.save_dir), "--save")
    if config.load:
        check_load(config)
    check_extras(config)  # peft, tensorboard, wandb and its login: before, not in, the actors
    if config.save_hf:
        check_writable(Path(config.save_hf), "--save-hf")
    try:
        check_writable(output, "--output-dir")
        if config.hf_checkpoint:
            try:
                check_weight_files(config.hf_checkpoint)  # headers only: a bad shard fails here
            except ModelError as exc:
                raise ConfigError(f"--hf-checkpoint {config.hf_checkpoint}: {exc}") from None
        if not config.policy_config.indexed_layers:
            source = (f"the policy from --hf-checkpoint {config.hf_checkpoint} has"
                      if config.hf_checkpoint else "--no-model-indexer: the embedded policy has")
            logging.getLogger(__name__).warning(
                "indexer replay: not applicable (%s no indexer block); indexer metrics are n/a",
                source)
        checkpoint, resolved = _checked_initial_checkpoint(config, output, engine)
    except BaseException:
        if created:  # a configuration error leaves no new output directory behind
            shutil.rmtree(output, ignore_errors=True)
        raise
    # written only now: a configuration error leaves an earlier run's record as it was
    if config.overwrite:
        clear_run(config)
    write_run_config(config, output)
    run_dir = create_run_dir()  # short path: AF_UNIX limit; stale ones of killed launchers go
    directory = None
    try:
        specs = specs if specs is not None else actor_specs(config, checkpoint, resolved=resolved)
        directory = Directory.for_run(run_dir, [s.name for s in specs], config.transport,
                                      curve_keys=config.curve_keys,
                                      heartbeat_deadline_s=config.heartbeat_deadline_s,
                                      shm=(config.shm_pool_bytes, config.shm_min_array_bytes))
        resume = checkpoint_next_step(Path(config.load)) if config.load else None
        with MetricsRecorder(output, config.num_steps, config.progress, hooks, config,
                             tensorboard=config.use_tensorboard, resume_step=resume,
                             wandb=config.use_wandb) as recorder:
            # built before any process starts: a bad tokenizer or prompt file stops the run here
            driver = DriverActors([s for s in specs if s.process == DRIVER], directory)
            try:
                async with Supervisor([s for s in specs if s.process != DRIVER], directory, run_dir,
                                      log_level=log_level, run_name=str(output),
                                      **start_supervision(config, specs),
                                      **engine_supervision(config, directory)) as supervisor:
                    # every actor answers: a console may attach (`replayrl repl --attach OUTPUT_DIR`)
                    write_attach_card(output, directory)
                    loop_task = asyncio.ensure_future(train_loop(directory, config, recorder.record))
                    watch_task = asyncio.ensure_future(supervisor.watch())
                    waited = {loop_task, watch_task, *([driver.task] if driver.task else [])}
                    try:
                        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for task in (loop_task, watch_task):
                            task.cancel()
                        await asyncio.gather(loop_task, watch_task, return_exceptions=True)
                    if driver.failure() is not None:
                        raise driver.failure()
                    if watch_task.done() and not watch_task.cancelled() and watch_task.exception():
                        raise watch_task.exception()
                    if not loop_task.cancelled() and loop_task.exception() is not None:
                        # a call cut off by a dying actor: report the death and its traceback
                        raise await supervisor.explain(loop_task.exception())
            finally:
                # after the actor processes: their last calls to the clock still find it
                await driver.stop()
        plot = recorder.plot()
        return RunResult(recorder.summary(time.perf_counter() - started), recorder.path, plot,
                         recorder.rows)
    except ActorDied as exc:  # under --colocate: say why the run cannot go on, and from where
        lost = explain_colocated_loss(config, exc, colocated_actors(config))
        if lost is exc:
            raise
        raise lost from exc.__cause__
    finally:
        if directory is not None:
            remove_attach_card(output, directory)
        shutil.rmtree(run_dir, ignore_errors=True)
