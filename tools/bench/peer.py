"""``replayrl bench peer``: replayrl against Hugging Face TRL's ``GRPOTrainer``, same budget.

Both sides start from the same ``checkpoint-init`` (written by
:func:`replayrl.tools.run.launcher.write_initial_checkpoint`; transformers' ``Qwen3MoeForCausalLM`` loads it
and ignores the DSA indexer weights), see the same prompt token ids in the same order (the
embedded task's seeded :class:`replayrl.rollout.text.data_source.PromptDataSource`, decoded to text for TRL
and checked to encode back to the same ids), are scored by the same verifier
(:meth:`replayrl.rollout.tasks.calculator.DigitToolEnv.reward` on the completion ids) and train with the same
budget: ``rollout-batch-size`` prompts x ``n-samples-per-prompt`` completions per optimizer
step, the same sampling, AdamW and PPO clip settings, no KL, the same advantage (std
normalisation as the task sets it: off for digits, on for sort), one optimizer
step per generation batch, on the same torch thread budget (TRL: one process with
``torch.set_num_threads(2)``; replayrl: its defaults, one thread per engine and one for the
trainer). replayrl runs through its real launcher (``--no-progress``) and its ``metrics.jsonl``
is read back; TRL runs in a child process that records each step's wall time with a
``TrainerCallback`` and each batch's rewards in the reward function.

replayrl runs its own recipe (the entropy bonus of its defaults on; TRL's GRPO loss has none);
``--same-objective`` trains TRL's loss exactly (:data:`SAME_OBJECTIVE`). Both sides train the same
function: where prompt + answer outgrow the DSA indexer's top-k, replayrl's side runs the
indexer-free model (:func:`same_function`; ``--sparse-model`` keeps the indexer).

Per seed the two sides run one after the other, alternating which goes first, so load on the
machine hits both. Printed: both sides' settings, then per seed and side the time to quality
(step seconds until the trailing ``--window``-step mean reward first reaches 0.9 x TRL's final
reward, or ``--threshold``; :mod:`replayrl.tools.bench.time_to_quality`), the reward both hold
after equal seconds, completions per second (``samples per step / median steady-state step
seconds``) and window means of the reward at fixed steps; every figure also as the ratio
replayrl / TRL.

TRL is an optional extra (``pip install 'replayrl[bench]'``), imported only in the child.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from replayrl.tools.bench.time_to_quality import (
    QUALITY_SHARE,
    seconds_to_threshold,
    time_to_quality,
)
from replayrl.tools.bench.tree_memory import run_sampled
from replayrl.tools.bench.usage import bench_parser
from replayrl.tools.errors import PeerBenchError
from replayrl.transport import strict_json

TRL_EXTRA = "pip install 'replayrl[bench]'  (the bench extra: trl>=1.16)"
TRL_THREADS = 2


# ---------------------------------------------------------------- pure summary functions


def median(values: Sequence[float]) -> float:
    """Median of ``values`` (mean of the middle two for an even count).

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("median of no values")
    s = sorted(values)
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2.0


def warmup_steps(steps: int) -> int:
    """Steps left out of the steady state: the first 10 % (at least one when ``steps >= 2``,
    none for a one-step run), so start-up and the first generation do not count."""
    return 0 if steps < 2 else max(1, steps // 10)


def completions_per_second(step_seconds: Sequence[float], completions_per_step: int) -> float:
    """``completions_per_step / median(steady-state step seconds)`` (completions / s).

    Steady state drops the first :func:`warmup_steps` steps.

    Raises:
        ValueError: no step.
    """
    steady = list(step_seconds)[warmup_steps(len(step_seconds)):]
    return completions_per_step / median(steady)


def report_windows(steps: int, window: int = 10) -> list[tuple[int, int]]:
    """1-based inclusive step ranges whose mean reward is reported: ``window`` steps ending at
    ``window`` and at 25 / 50 / 75 / 100 % of the run (deduplicated, in order); the whole run
    when it is shorter than ``window``."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if steps <= window:
        return [(1, steps)]
    ends = [window] + [max(window, round(steps * q)) for q in (0.25, 0.5, 0.75, 1.0)]
    return [(end - window + 1, end) for end in dict.fromkeys(ends)]


def window_mean(rewards: Sequence[float], first: int, last: int) -> float:
    """Mean of ``rewards`` over 1-based steps ``first .. last`` inclusive."""
    chunk = rewards[first - 1:last]
    if len(chunk) != last - first + 1:
        raise ValueError(f"steps {first}-{last} outside {len(rewards)} steps")
    return sum(chunk) / len(chunk)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """``ours / theirs``, or ``None`` when either is missing or ``theirs`` is 0."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


@dataclass(frozen=True)
class SideRun:
    """One side's run: per-step wall seconds, mean reward and trained completions; per step
    also (empty when not recorded) the generated tokens, the tokens the trainer forwarded
    (prompt + completion of every sample) and the trainer's seconds; the peak memory of the
    side's process tree in bytes (:mod:`replayrl.tools.bench.tree_memory`; None when the side
    ran in this process)."""

    side: str
    seed: int
    step_seconds: tuple[float, ...]
    rewards: tuple[float, ...]
    completions: tuple[int, ...]
    generated_tokens: tuple[int, ...] = ()
    trained_tokens: tuple[int, ...] = ()
    train_seconds: tuple[float, ...] = ()
    peak_rss_bytes: int | None = None
    peak_pss_bytes: int | None = None


@dataclass(frozen=True)
class SideSummary:
    """The figures of one :class:`SideRun` (completions / s, seconds to threshold or None,
    reward window means keyed ``"a-b"``)."""

    side: str
    seed: int
    completions_per_second: float
    seconds_to_threshold: float | None
    reward_windows: dict


def summarize(run: SideRun, threshold: float, window: int, steps: int | None = None) -> SideSummary:
    """The figures the table prints for one run; the reward windows
    (:func:`report_windows`) are placed over its first ``steps`` steps (None: all of them), so
    two runs of different lengths report the same windows.

    Raises:
        PeerBenchError: the run's steps trained different numbers of completions.
    """
    if len(set(run.completions)) != 1:
        raise PeerBenchError(f"{run.side} seed {run.seed}: completions per step vary: "
                             f"{sorted(set(run.completions))}")
    return SideSummary(
        run.side, run.seed, completions_per_second(run.step_seconds, run.completions[0]),
        seconds_to_threshold(run.rewards, run.step_seconds, threshold, window),
        {f"{a}-{b}": window_mean(run.rewards, a, b)
         for a, b in report_windows(len(run.rewards) if steps is None else steps, window)})


# ---------------------------------------------------------------- settings and inputs


def _fmt(x: float | None, spec: str = ".3f", none: str = "not reached") -> str:
    return none if x is None else format(x, spec)


def _engine_dtype(name: str) -> str:
    from replayrl.rollout.engines.precision import resolve_dtype  # imports torch: only when reporting

    return resolve_dtype(name)


SAME_OBJECTIVE = {"entropy-coef": 0.0}
"""replayrl settings under which its loss is TRL's ``GRPOTrainer`` loss exactly (``bench peer
--same-objective``): TRL's GRPO loss has no entropy bonus. On one batch the two updates are then
equal (tests/unit/trainer/test_trl_update_agreement.py)."""


DENSE_MODEL = {"model-indexer": False}
"""replayrl's side on the indexer-free model (``--no-model-indexer``): the dense-attention function
transformers' Qwen3-MoE (TRL's side) computes also where answers outgrow the indexer's top-k.
``bench peer --dense-model`` sets it at every point; by default :func:`same_function` sets it
where the indexer would make replayrl's model sparse."""
SPARSE_MODEL = {"model-indexer": True}
"""``bench peer --sparse-model``: replayrl's side keeps the embedded model's DSA indexer at every
point, so where prompt + answer outgrow ``index_topk`` it trains a sparse-attention model against
TRL's dense one (the report says so)."""


def same_function(steps: int, seed: int, overrides: dict | None = None) -> dict:
    """``overrides`` (flag name -> value) with :data:`DENSE_MODEL` added where replayrl's model
    would otherwise compute a function TRL's does not: no ``model-indexer`` setting given and
    the indexer would keep fewer keys than a trained query sees (:func:`indexer_is_dense` False).
    An explicit ``model-indexer`` (``--dense-model`` / ``--sparse-model``) is kept as given.

    Raises:
        replayrl.tools.run.config.ConfigError: ``overrides`` make no valid run.
    """
    overrides = dict(overrides or {})
    if "model-indexer" in overrides:
        return overrides
    config = run_config(steps, seed, "unused", overrides)
    return overrides if indexer_is_dense(config) else {**overrides, **DENSE_MODEL}


def run_config(steps: int, seed: int, output_dir: str, overrides: dict | None = None):
    """The replayrl :class:`replayrl.tools.run.config.RunConfig` of one side-run: replayrl's
    defaults (its own recipe, entropy bonus included: docs/design/trainer-math.md#entropy-collapse) with
    ``--no-progress``, then ``overrides`` (flag name -> value; :data:`SAME_OBJECTIVE` for TRL's
    objective)."""
    from replayrl.tools.run.from_flags import build_config

    return build_config({"num-steps": steps, "seed": seed, "output-dir": output_dir,
                         "progress": False, **(overrides or {})})


def trl_settings(config) -> dict:
    """TRL ``GRPOConfig`` keyword arguments matching replayrl's ``config`` (names checked
    against TRL 1.16's ``trl/trainer/grpo_config.py`` and transformers' ``TrainingArguments``).

    One optimizer step per generation batch of ``rollout_batch_size x n_samples_per_prompt``
    completions: ``per_device_train_batch_size`` = the whole batch, no gradient accumulation,
    ``steps_per_generation`` 1, ``num_iterations`` 1 (so TRL trains on-policy: its ratio is 1).
    """
    r, t = config.rollout, config.trainer
    batch = r.rollout_batch_size * r.n_samples_per_prompt
    return {
        "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1,
        "steps_per_generation": 1, "num_iterations": 1, "num_generations": r.n_samples_per_prompt,
        "max_completion_length": r.max_response_len, "temperature": r.temperature,
        "top_k": r.top_k if r.top_k > 0 else 0, "top_p": r.top_p,
        "min_p": r.min_p if r.min_p > 0 else None,
        "learning_rate": t.lr, "adam_beta1": t.adam_beta1, "adam_beta2": t.adam_beta2,
        "adam_epsilon": t.adam_eps, "weight_decay": t.weight_decay, "max_grad_norm": t.clip_grad,
        "optim": "adamw_torch", "lr_scheduler_type": "constant", "warmup_steps": 0,
        "epsilon": t.eps_clip, "epsilon_high": t.eps_clip_high, "beta": 0.0,
        "scale_rewards": "group" if t.normalize_advantage_std else "none",
        "loss_type": "dapo", "mask_truncated_completions": r.append_eos_on_truncation,
        "router_aux_loss_coef": 0.0, "use_cpu": True, "bf16": False, "fp16": False,
        "gradient_checkpointing": False, "shuffle_dataset": False, "seed": r.seed,
        "max_steps": config.num_steps, "logging_steps": 1, "save_strategy": "no",
        "report_to": "none", "disable_tqdm": True, "log_completions": False,
        "dataloader_num_workers": 0,
    }


def settings_table(config) -> str:
    """Markdown table of both sides' settings (values from ``config`` and :func:`trl_settings`)."""
    r, t = config.rollout, config.trainer
    k = trl_settings(config)
    batch = r.rollout_batch_size * r.n_samples_per_prompt
    from replayrl.tools.run.launcher import IDLE_SPIN_COUNT, idle_thread_env  # the launcher's rule
    from replayrl.trainer.loss.advantages import STD_EPS  # the trainer's, as it trains
    std_eps = f"{STD_EPS:.0e}".replace("e-0", "e-")  # 1e-06 -> 1e-6
    short_spin = idle_thread_env(config)
    rows = [
        ("prompts x samples per optimizer step",
         f"{r.rollout_batch_size} x {r.n_samples_per_prompt} = {batch}",
         f"per_device_train_batch_size={k['per_device_train_batch_size']}, "
         f"num_generations={k['num_generations']}, gradient_accumulation_steps=1, "
         f"steps_per_generation=1, num_iterations=1"),
        ("new tokens", str(r.max_response_len), f"max_completion_length={k['max_completion_length']}"),
        ("sampling", f"temperature {r.temperature}, top-k {r.top_k}, top-p {r.top_p}, min-p {r.min_p}",
         f"temperature={k['temperature']}, top_k={k['top_k']}, top_p={k['top_p']}, min_p={k['min_p']}"),
        ("AdamW", f"lr {t.lr}, betas ({t.adam_beta1}, {t.adam_beta2}), eps {t.adam_eps}, "
                  f"weight decay {t.weight_decay}, grad-norm clip {t.clip_grad}, constant lr",
         f"learning_rate={k['learning_rate']}, adam_beta1={k['adam_beta1']}, "
         f"adam_beta2={k['adam_beta2']}, adam_epsilon={k['adam_epsilon']}, weight_decay={k['weight_decay']}, "
         f"max_grad_norm={k['max_grad_norm']}, optim=adamw_torch, lr_scheduler_type=constant"),
        ("PPO clip", f"[1 - {t.eps_clip}, 1 + {t.eps_clip_high}]",
         f"epsilon={k['epsilon']}, epsilon_high={k['epsilon_high']}"),
        ("KL / entropy / advantage", f"no KL; entropy bonus {t.entropy_coef}"
                                     + (" (replayrl's default recipe; TRL has none: "
                                        "--same-objective turns it off)" if t.entropy_coef else "")
                                     + (", centred on the step's mean surprisal (--entropy-baseline)"
                                        if t.entropy_coef and t.entropy_baseline else "")
                                     + (f", rising linearly over the first {t.entropy_coef_warmup_steps} "
                                        "steps (--entropy-coef-warmup-steps)"
                                        if t.entropy_coef and t.entropy_coef_warmup_steps else "")
                                     + "; reward - group mean"
                                     + (f" / (group std + {std_eps}), the population std (divides by n)"
                                        if t.normalize_advantage_std else " (no std)"),
         f"beta=0.0; scale_rewards={k['scale_rewards']!r}"
         # trl.trainer.utils.nanstd applies Bessel's correction; grpo_trainer adds 1e-4
         + (f" (group std with Bessel's correction, + 1e-4: its advantages are "
            f"{math.sqrt((r.n_samples_per_prompt - 1) / r.n_samples_per_prompt):.3f}x replayrl's "
            f"at {r.n_samples_per_prompt} samples: AdamW's update is blind to a constant factor, "
            f"the entropy bonus beside it is not)"
            if t.normalize_advantage_std and r.n_samples_per_prompt > 1 else "")),
        ("loss", "PPO clipped token loss / loss tokens of the step, TIS cap "
                 f"{t.tis_cap} on the one-step-stale behaviour ratio",
         f"loss_type={k['loss_type']!r} (token sum / active tokens of the step), "
         f"mask_truncated_completions={k['mask_truncated_completions']}; on-policy (ratio 1)"),
        ("policy / logprobs", f"trainer fp32, engine {_engine_dtype(config.engine_dtype)} "
                              f"(--engine-dtype {config.engine_dtype}); logprobs over the "
                              "sampler's top-k support with "
                              + ("routing / indexer replay" if config.policy_config.index_topk
                                 else "routing replay (no indexer: --no-model-indexer)"),
         "fp32 (bf16=False) for both generation and training; logprobs over the full vocabulary"),
        ("staleness", "one step (generation of k+1 overlaps training on k)" if not config.colocate
         else "one step (generation of k+1 and training on k take turns in one process)",
         "0 (generate, then train)"),
        ("threads", f"engine {config.engine_torch_threads} + trainer {t.torch_threads}"
                    + (f" (its backward {t.backward_threads}: --trainer-backward-threads)"
                       if t.backward_switch_threads else "")
                    + " (one process each)"
                    + (f"; GOMP_SPINCOUNT={IDLE_SPIN_COUNT} in {', '.join(sorted(short_spin))}"
                       if short_spin else "")
                    if not config.colocate else
                    f"{t.torch_threads} (--colocate: clock, manager, engine and trainer in one "
                    "process)", f"torch.set_num_threads({TRL_THREADS}), one process; "
                                f"GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', 'unset')}, "
                                f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}"),
        ("other", "--no-progress" + (f"; indexer_drift_rate every {t.indexer_drift_interval} steps "
                                     "(--indexer-drift-interval)"
                                     if config.policy_config.index_topk else ""),
         "use_cpu=True, gradient_checkpointing=False, router_aux_loss_coef=0.0, "
         "shuffle_dataset=False, logging_steps=1, save_strategy='no', report_to='none'"),
    ]
    return "\n".join(["| setting | replayrl | TRL GRPOTrainer |", "|---|---|---|",
                      *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def parse_backward_threads(text: str | None) -> int | dict[str, int] | None:
    """``--trainer-backward-threads`` of the bench: ``None``, ``"N"`` (every point) or
    ``"SIZE=N,..."`` (per ``--model-size`` preset) -> None, N or ``{size: N}``.

    Raises:
        ValueError: not an int >= 0, an unknown size, or a size named twice.
    """
    from replayrl.rollout.model.config import MODEL_SIZES

    def count(n: str) -> bool:  # ASCII digits: str.isdigit() also takes "²", which int() refuses
        return n.strip().isascii() and n.strip().isdigit()

    if text is None:
        return None
    if "=" not in text:
        if not count(text):
            raise ValueError(f"expected N or SIZE=N,... (N an int >= 0), got {text!r}")
        return int(text)
    out: dict[str, int] = {}
    for item in text.split(","):
        size, _, n = item.partition("=")
        size = size.strip()
        if size not in MODEL_SIZES or not count(n) or size in out:
            raise ValueError(f"{item!r}: expected SIZE=N with SIZE one of {', '.join(MODEL_SIZES)} "
                             f"(each once) and N an int >= 0")
        out[size] = int(n)
    return out


def prompt_stream(config, checkpoint: Path | None = None) -> list:
    """The prompts replayrl's RolloutManager draws for ``config.num_steps`` steps, in order:
    ``rollout_batch_size`` per step from the same seeded data source (``rollout/dispatch/manager.py``).

    The digits task's come from its generator; the sort task's (``--task sort``) through the
    manager's own path (:func:`replayrl.rollout.text.prompt_data.load_run_prompts` with the tokenizer of
    ``checkpoint``, the run's checkpoint-init)."""
    from replayrl.rollout.text.data_source import PromptDataSource

    r = config.rollout
    if is_sort(config):
        from replayrl.rollout.text.prompt_data import load_run_prompts
        from replayrl.rollout.text.tokenizer import load_tokenizer

        model = config.policy_config
        prompts = load_run_prompts(r, load_tokenizer(checkpoint), vocab_size=model.vocab_size,
                                   max_positions=model.max_position_embeddings)
        source = PromptDataSource(prompts.train, r.seed, r.num_epoch, prompts.name)
    else:
        from replayrl.rollout.tasks.digit_puzzle import DigitTask
        from replayrl.rollout.tasks.digits import digit_task_prompts

        source = PromptDataSource(digit_task_prompts(DigitTask(num_digits=r.num_digits,
                                                               num_values=r.num_values),
                                                     r.seed, r.dataset_size), r.seed)
    return source.next_batch(config.num_steps * r.rollout_batch_size)


def is_sort(config) -> bool:
    """The run trains the sort task (``--task sort``); else the digits task (the only two the
    bench runs on both sides)."""
    return config.rollout.task == "sort"


def prompt_tokens(config) -> int:
    """Tokens of every prompt of the run's task: ``--answer-tokens + 2`` (sort) or
    ``--num-digits + 3`` (digits)."""
    r = config.rollout
    return r.answer_tokens + 2 if is_sort(config) else r.num_digits + 3


def indexer_is_dense(config) -> bool:
    """True when replayrl's model computes transformers' dense attention, which ignores the
    indexer weights: it has no indexer (``--no-model-indexer``, :data:`DENSE_MODEL`), or the
    indexer keeps every key of every query that produces a trained logit (prompt length + new
    tokens - 1 <= index_topk)."""
    top = config.policy_config.index_topk
    positions = prompt_tokens(config) + config.rollout.max_response_len - 1
    return top == 0 or positions <= top


def function_compared(config) -> str:
    """One phrase for the reports: whether replayrl's model under ``config`` computes the function
    TRL's transformers model does (dense attention; :func:`indexer_is_dense`), and why."""
    if config.policy_config.index_topk == 0:
        return "replayrl's model has no indexer (--no-model-indexer): both compute the same function"
    if indexer_is_dense(config):
        return ("every query that produces a trained logit sees at most index_topk keys, so the "
                "indexer keeps all of them: both compute the same function")
    return ("prompt + answer outgrow index_topk: TRL trains the dense-attention model, replayrl "
            "the sparse one (--sparse-model)")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- the two sides


def launch_rows(config) -> list[dict]:
    """Run ``replayrl train`` with ``config`` through its launcher, in this process's event
    loop, and return its ``metrics.jsonl`` rows (one dict per step)."""
    from replayrl.actors import run_event_loop
    from replayrl.tools.run.launcher import launch

    result = run_event_loop(launch(config))
    return [strict_json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]


def run_replayrl(config) -> SideRun:
    """Run replayrl through its launcher and read ``metrics.jsonl`` back.

    Raises:
        PeerBenchError: a step was skipped, or its prompts differ from :func:`prompt_stream`.
    """
    rows = launch_rows(config)
    expected_prompts = prompt_stream(config, Path(config.output_dir) / "checkpoint-init")
    expected = [p.index for p in expected_prompts]
    b = config.rollout.rollout_batch_size
    for row in rows:
        if row.get("skipped"):
            raise PeerBenchError(f"replayrl step {row['step']} skipped ({row.get('skip_reason')})")
        if row["prompt_indices"] != expected[row["step"] * b:(row["step"] + 1) * b]:
            raise PeerBenchError(f"replayrl step {row['step']}: prompts differ from the stream "
                                 "given to TRL")
    n = config.rollout.n_samples_per_prompt
    prompt_tokens = [n * sum(len(p.prompt_ids) for p in expected_prompts[r["step"] * b:(r["step"] + 1) * b])
                     for r in rows]
    generated = [round(r["samples"] * r["response_len_mean"]) for r in rows]
    return SideRun("replayrl", config.rollout.seed, tuple(r["step_seconds"] for r in rows),
                   tuple(r["reward_mean"] for r in rows), tuple(r["samples"] for r in rows),
                   tuple(generated), tuple(g + p for g, p in zip(generated, prompt_tokens)),
                   tuple(r["train_seconds"] for r in rows))


def run_trl(config, checkpoint: Path, work: Path) -> SideRun:
    """Run TRL's ``GRPOTrainer`` in a child process (:func:`trl_worker`) and read its result.

    Raises:
        PeerBenchError: ``trl`` is not installed (names the extra) or the child failed.
    """
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise PeerBenchError(f"bench peer needs TRL, which is not installed: {TRL_EXTRA}")
    prompts = prompt_stream(config, checkpoint)
    spec = {"checkpoint": str(checkpoint), "output_dir": str(work / "trl"),
            "grpo_config": trl_settings(config), "threads": TRL_THREADS,
            "num_digits": config.rollout.num_digits, "num_values": config.rollout.num_values,
            "batch": config.rollout.rollout_batch_size, "task": "sort" if is_sort(config) else "digits",
            "prompts": [{"index": p.index, "ids": [int(i) for i in p.prompt_ids],
                         "answer_id": int(p.answer_id), "label": p.label} for p in prompts]}
    spec_path, result_path = work / "trl_spec.json", work / "trl_result.json"
    spec_path.write_text(strict_json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(TRL_THREADS), "TOKENIZERS_PARALLELISM": "false",
           "TRANSFORMERS_VERBOSITY": "error"}
    proc, memory = run_sampled([sys.executable, "-m", "replayrl.tools.bench.peer", "--trl-worker",
                                str(spec_path), str(result_path)], env)
    if proc.returncode != 0:
        raise PeerBenchError(f"TRL side failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(result_path.read_text())
    return SideRun("TRL", config.rollout.seed, tuple(out["step_seconds"]), tuple(out["rewards"]),
                   tuple(out["completions"]), tuple(out["generated_tokens"]),
                   tuple(g + p for g, p in zip(out["generated_tokens"], out["prompt_tokens"])),
                   tuple(s - g for s, g in zip(out["step_seconds"], out["generate_seconds"])),
                   memory.peak_rss_bytes, memory.peak_pss_bytes)


def trl_worker(spec_path: str, result_path: str) -> None:
    """Child process: train with TRL's ``GRPOTrainer`` as ``spec_path`` says, write per-step
    seconds, mean rewards and completions to ``result_path`` (JSON).

    Raises:
        PeerBenchError: TRL's tokenizer would not give the prompts' exact ids, a batch's
            prompts are not the expected step's, or a step count differs from ``max_steps``.
    """
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    import numpy as np
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from replayrl.rollout.tasks.calculator import DigitToolEnv
    from replayrl.rollout.tasks.digit_puzzle import DigitTask

    task = DigitTask(num_digits=spec["num_digits"], num_values=spec["num_values"])
    env = DigitToolEnv(task)
    tokenizer = AutoTokenizer.from_pretrained(spec["checkpoint"])
    texts = [task.decode(p["ids"]) for p in spec["prompts"]]
    # TRL tokenizes a text prompt with processing_class(text=prompts)["input_ids"]
    # (GRPOTrainer._tokenize_prompts); the same call must give back the replayrl ids
    encoded = tokenizer(text=texts)["input_ids"]
    for p, ids in zip(spec["prompts"], encoded):
        if list(ids) != p["ids"]:
            raise PeerBenchError(f"prompt {p['index']}: TRL's tokenizer gives {list(ids)}, "
                                 f"replayrl trains on {p['ids']}")
    lengths = {p["index"]: len(p["ids"]) for p in spec["prompts"]}
    dataset = Dataset.from_dict({"prompt": texts,
                                 "answer_id": [p["answer_id"] for p in spec["prompts"]],
                                 "label": [p["label"] for p in spec["prompts"]],
                                 "prompt_index": [p["index"] for p in spec["prompts"]]})
    sort = spec["task"] == "sort"
    if sort:  # the sort task's verifier: digits' token ids and the checkpoint's EOS
        from replayrl.rollout.tasks.sort import position_reward

        vocab = tokenizer.get_vocab()
        eos_ids = (int(tokenizer.eos_token_id),)
    n = spec["grpo_config"]["num_generations"]
    rewards: list[float] = []
    completions_seen: list[int] = []
    seen: list[list[int]] = []
    generated_tokens: list[int] = []
    prompt_tokens: list[int] = []

    def digit_task_verifier(prompts, completions, completion_ids, answer_id, label, prompt_index, **_):
        """The embedded task's verifier on each completion's ids (TRL keeps the EOS, drops what
        follows it; replayrl's engine stops at it), with a loss mask of ones (one turn); for the
        sort task :func:`replayrl.rollout.tasks.sort.position_reward` against the label's digits."""
        if sort:
            out = [position_reward(np.asarray(ids, dtype=np.int64),
                                   np.asarray([vocab[d] for d in lab.split()], dtype=np.int64), eos_ids)
                   for ids, lab in zip(completion_ids, label)]
        else:
            out = [env.reward(np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=np.uint8),
                              int(a)) for ids, a in zip(completion_ids, answer_id)]
        rewards.append(float(np.mean(out)))
        completions_seen.append(len(out))
        generated_tokens.append(sum(len(ids) for ids in completion_ids))
        prompt_tokens.append(sum(lengths[i] for i in prompt_index))
        seen.append(list(prompt_index[::n]))  # TRL repeats each prompt n times in a row
        return out

    class StepTimer(TrainerCallback):
        """Wall seconds between successive optimizer steps (the first from its step's start)."""

        def __init__(self) -> None:
            self.last = None
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if self.last is None:
                self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.seconds.append(now - self.last)
            self.last = now

    timer = StepTimer()
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32)
    generate_seconds: list[float] = []
    generate = model.generate

    def timed_generate(*args, **kwargs):
        """model.generate, its wall seconds added to the current step's (GRPOTrainer calls it
        on this very model: no DeepSpeed / FSDP wrapper on one CPU process)."""
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            while len(generate_seconds) <= len(timer.seconds):
                generate_seconds.append(0.0)
            generate_seconds[len(timer.seconds)] += time.perf_counter() - start

    model.generate = timed_generate
    args = GRPOConfig(output_dir=spec["output_dir"], **spec["grpo_config"])
    trainer = GRPOTrainer(model=model, reward_funcs=digit_task_verifier, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    steps = spec["grpo_config"]["max_steps"]
    if not len(timer.seconds) == len(rewards) == steps:
        raise PeerBenchError(f"TRL ran {len(timer.seconds)} optimizer steps and scored "
                             f"{len(rewards)} batches, expected {steps}")
    b = spec["batch"]
    expected = [p["index"] for p in spec["prompts"]]
    for step, got in enumerate(seen):
        if got != expected[step * b:(step + 1) * b]:
            raise PeerBenchError(f"TRL step {step}: prompts {got} are not the stream's "
                                 f"{expected[step * b:(step + 1) * b]}")
    if len(generate_seconds) != steps:
        raise PeerBenchError(f"TRL generated in {len(generate_seconds)} steps, expected {steps}")
    Path(result_path).write_text(strict_json.dumps(
        {"step_seconds": timer.seconds, "rewards": rewards, "completions": completions_seen,
         "generated_tokens": generated_tokens, "prompt_tokens": prompt_tokens,
         "generate_seconds": generate_seconds}))


# ---------------------------------------------------------------- report


def run_seed(steps: int, seed: int, work: Path, trl_first: bool,
             overrides: dict | None = None,
             replayrl_steps: int | None = None) -> tuple[SideRun, SideRun, dict]:
    """Both sides for one seed, in the order given; returns ``(replayrl, TRL, facts)``.

    TRL runs ``steps`` optimizer steps, replayrl ``replayrl_steps`` (default ``steps``) over the
    same prompt stream: TRL's prompts are the stream's first ``steps`` batches either way.

    Raises:
        PeerBenchError: the checkpoint replayrl trained from is not the one TRL loaded.
    """
    from replayrl.tools.run.launcher import write_initial_checkpoint

    overrides = same_function(steps, seed, overrides)
    config = run_config(replayrl_steps or steps, seed, str(work / "replayrl"), overrides)
    trl_config = run_config(steps, seed, str(work / "replayrl"), overrides)
    checkpoint = write_initial_checkpoint(config, work / "checkpoint-init")
    sides = {}
    for side in (("TRL", "replayrl") if trl_first else ("replayrl", "TRL")):
        sides[side] = (run_trl(trl_config, checkpoint, work) if side == "TRL"
                       else run_replayrl(config))
    ours = work / "replayrl" / "checkpoint-init" / "model.safetensors"
    if _sha256(ours) != _sha256(checkpoint / "model.safetensors"):
        raise PeerBenchError("replayrl's checkpoint-init differs from the one TRL loaded")
    return sides["replayrl"], sides["TRL"], {"order": list(sides), "config": config}


def report(pairs: list[tuple[SideRun, SideRun, dict]], threshold: float | None, window: int) -> str:
    """The printed report: settings, one table per seed, and the spread over seeds.

    ``threshold`` None: per seed, :data:`replayrl.tools.bench.time_to_quality.QUALITY_SHARE`
    x TRL's mean reward over its last ``window`` steps (time to quality); else that reward."""
    config = pairs[0][2]["config"]
    r = config.rollout
    per_step = r.rollout_batch_size * r.n_samples_per_prompt
    target = (f"{QUALITY_SHARE} x TRL's mean reward over its last {window} steps (per seed)"
              if threshold is None else f"{threshold}")
    trl_steps = len(pairs[0][1].step_seconds)
    steps = (f"{config.num_steps} steps" if config.num_steps == trl_steps
             else f"{config.num_steps} replayrl / {trl_steps} TRL steps")
    lines = [
        f"bench peer: replayrl vs TRL GRPOTrainer, {steps} x {per_step} "
        f"completions per optimizer step, seeds {' '.join(str(p[0].seed) for p in pairs)}",
        "",
        "Both load the same checkpoint-init (Hugging Face Qwen3-MoE directory; sha256 of "
        "model.safetensors checked equal). transformers' Qwen3MoeForCausalLM ignores the DSA "
        "indexer weights (dense attention); "
        + function_compared(config) + ".",
        "Same prompt token ids in the same order (checked on both sides), same verifier "
        "(replayrl.rollout.tasks.calculator.DigitToolEnv.reward on the completion ids).",
        "",
        settings_table(config),
        "",
        f"completions/s = {per_step} / median step seconds over steps after each side's first "
        f"10 % (warmup_steps); time to reward: summed step seconds until the trailing "
        f"{window}-step mean reward >= {target}; reward after equal seconds: each side's trailing "
        f"{window}-step mean after the shorter side's total step seconds; ratio = replayrl / TRL.",
    ]
    summaries = []
    for ours, theirs, facts in pairs:
        q = time_to_quality(ours.rewards, ours.step_seconds, theirs.rewards, theirs.step_seconds,
                            window)
        thr = q.threshold if threshold is None else threshold
        # with --replayrl-steps one side ran longer: both report windows over the steps both ran
        both = min(len(ours.rewards), len(theirs.rewards))
        a, b = summarize(ours, thr, window, both), summarize(theirs, thr, window, both)
        summaries.append((a, b))
        lines += ["", f"seed {ours.seed} (ran {' then '.join(facts['order'])}; completions per "
                      f"step: replayrl {ours.completions[0]}, TRL {theirs.completions[0]})", "",
                  "| figure | replayrl | TRL | replayrl / TRL |", "|---|---:|---:|---:|",
                  _row(f"step seconds to {window}-step mean reward >= {thr:.3f}",
                       a.seconds_to_threshold, b.seconds_to_threshold, ".1f"),
                  _row(f"reward after {q.equal_seconds:.1f} s", q.reward_ours, q.reward_theirs,
                       ".3f"),
                  _row("completions/s", a.completions_per_second, b.completions_per_second, ".1f"),
                  _row("median step seconds", per_step / a.completions_per_second,
                       per_step / b.completions_per_second, ".3f"),
                  _row("total step seconds", sum(ours.step_seconds), sum(theirs.step_seconds), ".1f"),
                  *(_row(f"reward, steps {k}", a.reward_windows[k], b.reward_windows[k], ".3f")
                    for k in a.reward_windows)]
    if len(pairs) > 1:
        lines += ["", f"over {len(pairs)} seeds: min - max (mean)", "",
                  "| figure | replayrl | TRL | ratio of means | ranges overlap |",
                  "|---|---:|---:|---:|---|"]
        keys = [("completions/s", lambda s: s.completions_per_second, ".1f"),
                (f"step seconds to reward >= {target}", lambda s: s.seconds_to_threshold, ".1f"),
                *((f"reward, steps {k}", (lambda s, k=k: s.reward_windows[k]), ".3f")
                  for k in summaries[0][0].reward_windows)]
        for name, get, spec in keys:
            lines.append(_spread_row(name, [get(a) for a, _ in summaries],
                                     [get(b) for _, b in summaries], spec))
    return "\n".join(lines)


def _row(name: str, ours: float | None, theirs: float | None, spec: str) -> str:
    return (f"| {name} | {_fmt(ours, spec)} | {_fmt(theirs, spec)} | "
            f"{_fmt(ratio(ours, theirs), '.2f', 'n/a')} |")


def spread(values: Sequence[float | None]) -> tuple[float, float, float] | None:
    """``(min, max, mean)`` of ``values``; ``None`` when any is ``None`` (a seed never got there)."""
    if not values or any(v is None for v in values):
        return None
    return min(values), max(values), sum(values) / len(values)


def overlap(a: tuple[float, float, float] | None, b: tuple[float, float, float] | None) -> bool | None:
    """Whether the ``[min, max]`` ranges of two :func:`spread` results intersect (None if either is)."""
    if a is None or b is None:
        return None
    return a[0] <= b[1] and b[0] <= a[1]


def _spread_row(name: str, ours: list, theirs: list, spec: str) -> str:
    a, b = spread(ours), spread(theirs)

    def cell(s):
        return ("not reached by every seed" if s is None
                else f"{s[0]:{spec}} - {s[1]:{spec}} ({s[2]:{spec}})")

    both = overlap(a, b)
    return (f"| {name} | {cell(a)} | {cell(b)} | "
            f"{_fmt(ratio(a and a[2], b and b[2]), '.2f', 'n/a')} | "
            f"{'n/a' if both is None else ('yes' if both else 'no')} |")


def bench(steps: int, seeds: Sequence[int], threshold: float | None, window: int,
          overrides: dict | None = None, replayrl_steps: int | None = None) -> str:
    """Run both sides for every seed (alternating which goes first) and return the report;
    ``replayrl_steps``: replayrl's steps when not ``steps`` (:func:`run_seed`)."""
    pairs = []
    with tempfile.TemporaryDirectory(prefix="rrl-peer-") as tmp:
        for i, seed in enumerate(seeds):
            work = Path(tmp) / f"seed-{seed}"
            work.mkdir()
            pairs.append(run_seed(steps, seed, work, trl_first=bool(i % 2), overrides=overrides,
                                  replayrl_steps=replayrl_steps))
    return report(pairs, threshold, window)


def main(argv: list[str] | None = None, grid=None) -> int:
    """Command-line entry: prints the report (``--trl-worker SPEC RESULT`` is the TRL child).

    ``grid``: how ``--grid`` runs, ``grid(args, overrides, parser) -> report`` (given by
    :func:`replayrl.tools.bench.peer_grid.main`, the ``replayrl bench peer`` entry; this module
    does not import the grid, which imports it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--trl-worker"]:
        trl_worker(argv[1], argv[2])
        return 0
    parser = bench_parser("peer", __doc__)
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per side (default: 100; with --grid: quick 20, "
                             "else 30)")
    parser.add_argument("--replayrl-steps", type=int, default=None,
                        help="replayrl's optimizer steps when not --steps: time to quality needs "
                             "the faster side to run at least the slower side's seconds (TRL's "
                             "prompts are the first --steps batches of the same stream) "
                             "(default: --steps)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1],
                        help="one comparison per seed")
    parser.add_argument("--threshold", type=float, default=None,
                        help="reward the trailing window mean must reach (default: time to "
                             f"quality, {QUALITY_SHARE} x TRL's mean over its last --window steps)")
    parser.add_argument("--window", type=int, default=10, help="steps per reward window")
    parser.add_argument("--rollout-batch-size", type=int, default=None,
                        help="prompts per step (default: replayrl's)")
    parser.add_argument("--n-samples-per-prompt", type=int, default=None,
                        help="samples per prompt (default: replayrl's)")
    parser.add_argument("--priority", action="store_true",
                        help="on a machine shared with other users' jobs, run both "
                             "sides first (Linux autogroup nice -20; needs root)")
    parser.add_argument("--grid", nargs="?", const="quick", default=None, metavar="GRID",
                        help="model size x answer length grid (tools/bench/peer_grid.py): quick "
                             "(1m x {2, 64}, the default of a bare --grid), full ({1m, 10m, 50m} "
                             "x {2, 64, 256}) or SIZES:LENGTHS such as 1m,10m:2,64; every point at every "
                             "--seeds seed, time to quality per seed and over seeds (rates and "
                             "plots: the first seed) (default: no grid, one comparison)")
    from replayrl.rollout.model.config import MODEL_SIZES

    parser.add_argument("--model-size", default=None, choices=MODEL_SIZES,
                        help="the embedded model's size preset; --grid sets it per point "
                             "(default: replayrl's)")
    parser.add_argument("--same-objective", action="store_true",
                        help="run replayrl with TRL's loss exactly (--entropy-coef 0) "
                             "(default: off, replayrl's own recipe, entropy bonus on)")
    parser.add_argument("--entropy-baseline", action="store_true",
                        help="run replayrl with its entropy bonus centred on the step's mean "
                             "surprisal (--entropy-baseline: docs/design/trainer-math.md#entropy-baseline)")
    parser.add_argument("--entropy-coef-warmup-steps", type=int, default=None, metavar="N",
                        help="run replayrl with its entropy bonus rising linearly over its first N "
                             "steps (docs/design/trainer-math.md#entropy-warmup) (default: "
                             "replayrl's)")
    indexer = parser.add_mutually_exclusive_group()
    indexer.add_argument("--dense-model", action="store_true",
                         help="run replayrl's side on the indexer-free model (--no-model-indexer) "
                              "at every point (default: only where prompt + answer outgrow the "
                              "indexer's top-k, so that both sides train the dense-attention "
                              "function TRL's transformers model computes)")
    indexer.add_argument("--sparse-model", action="store_true",
                         help="keep the embedded model's DSA indexer at every point: where prompt "
                              "+ answer outgrow its top-k replayrl then trains a sparse-attention "
                              "model against TRL's dense one, as the report says (default: off)")
    parser.add_argument("--colocate", action="store_true",
                        help="run replayrl's side with --colocate (clock, manager, engine and "
                             "trainer in one process: docs/design/actors.md#colocate)")
    parser.add_argument("--trainer-backward-threads", default=None, metavar="N|SIZE=N,...",
                        help="run replayrl's side with --trainer-backward-threads N (its "
                             "backward passes on N torch threads); with --grid per model size, "
                             "e.g. 10m=2,50m=2 (default: replayrl's, also for sizes not named)")
    parser.add_argument("--output-dir", default="runs/peer-grid",
                        help="where --grid writes its plots peer_grid.png and peer_grid_reward.png")
    args = parser.parse_args(argv)
    if args.same_objective and args.entropy_baseline:
        parser.error("--entropy-baseline centres the entropy bonus that --same-objective turns off")
    if args.same_objective and args.entropy_coef_warmup_steps:
        parser.error("--entropy-coef-warmup-steps ramps the entropy bonus that --same-objective turns off")
    if args.steps is None:
        args.steps = 100 if args.grid is None else {"quick": 20}.get(args.grid, 30)
    if args.steps < 1 or args.window < 1 or (args.replayrl_steps is not None and args.replayrl_steps < 1):
        parser.error("--steps, --replayrl-steps and --window must be >= 1")
    if len(set(args.seeds)) != len(args.seeds):  # refused now, not after the first seed's runs
        parser.error(f"--seeds names a seed twice: {' '.join(map(str, args.seeds))}")
    try:
        backward = parse_backward_threads(args.trainer_backward_threads)
    except ValueError as exc:
        parser.error(f"--trainer-backward-threads: {exc}")
    if args.model_size is not None and args.grid is not None:
        parser.error("--model-size with --grid: the grid sets the size per point")
    if isinstance(backward, dict) and args.grid is None:
        parser.error("--trainer-backward-threads SIZE=N needs --grid (one model size otherwise)")
    args.size_overrides = ({size: {"trainer-backward-threads": n} for size, n in backward.items()}
                           if isinstance(backward, dict) else {})
    overrides = {**(SAME_OBJECTIVE if args.same_objective else {}),
                 **({"entropy-baseline": True} if args.entropy_baseline else {}),
                 **(DENSE_MODEL if args.dense_model else SPARSE_MODEL if args.sparse_model else {})}
    overrides.update({k: v for k, v in (("model-size", args.model_size),
                                        ("rollout-batch-size", args.rollout_batch_size),
                                        ("n-samples-per-prompt", args.n_samples_per_prompt),
                                        ("colocate", args.colocate or None),
                                        ("entropy-coef-warmup-steps", args.entropy_coef_warmup_steps),
                                        ("trainer-backward-threads",
                                         backward if isinstance(backward, int) else None))
                      if v is not None})
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        from replayrl.tools.run.exit_codes import EXIT_CONFIG

        print(f"replayrl bench peer: TRL is not installed; {TRL_EXTRA}", file=sys.stderr)
        return EXIT_CONFIG
    from replayrl.tools.bench.priority import autogroup_priority

    if args.grid is not None and grid is None:
        parser.error("--grid runs through `replayrl bench peer` (python -m replayrl.tools.bench.peer_grid)")
    with autogroup_priority(args.priority):
        if args.grid is not None:
            report = grid(args, overrides, parser)
        else:
            report = bench(args.steps, args.seeds, args.threshold, args.window, overrides,
                           args.replayrl_steps)
    print(("--priority: both sides ran ahead of other sessions' jobs (tools/bench/priority.py)\n\n"
           if args.priority else "") + report, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
