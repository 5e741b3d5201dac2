"""``replayrl bench gpu``: the prepared GPU check, one command that fits a 10-minute device call.

On a CUDA device it runs, in order, each step timed and with its peak memory: the placement of
the torch and fsdp trainers, the embedded engine and its KV cache, and the proximal cache; the
bf16 parity of the engine against the trainer with every replay on (flips must be 0); the
weight push of a ~1 B model (pack on the trainer's device, load into the engine's); generation
and trainer tokens/s; a short training run (``replayrl train --device cuda``); and the tests
marked ``gpu`` (``pytest -m gpu``, from a source checkout). It prints one table and writes every
figure to ``--output-dir/gpu.json``; the exit status is 0 when every step that ran passed.

``--dry-run`` checks the environment (torch build, CUDA, bf16, NCCL, the tests) and prints
which steps would run or be skipped and why, with their time budgets, then exits 0: on a CPU
machine it says what a GPU call would do. ``--device cpu`` runs the same steps on the CPU, at
sizes that suit it (how CI exercises the check). How to run it on a lent device, and what to
carry there: docs/gpu.md.
"""
from __future__ import annotations

import gc
import json
import math
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from replayrl.tools.bench.usage import bench_parser
from replayrl.transport import strict_json

STEPS: dict[str, tuple[str, int]] = {
    "placement": ("torch and fsdp trainers, embedded engine, KV cache and proximal cache on the "
                  "device", 40),
    "parity": ("bf16 engine against the trainer, every replay on: routing / indexer flips 0", 40),
    "push": ("weight push of the --push-size model: pack on the device, load into the engine", 60),
    "generation": ("embedded engine generation tokens/s", 40),
    "trainer": ("trainer tokens/s (forward, backward, optimizer step)", 40),
    "train-run": ("replayrl train --device DEVICE, a short run through the launcher", 150),
    "gpu-tests": ("the tests marked gpu (pytest -m gpu, the test files that hold them)", 180),
}
"""Step name -> (what it checks, its time budget in seconds on one H100). The budgets add up to
under the 10 minutes of one device call."""

SKIPPED = "not selected (--steps)"
"""Why a step left out of ``--steps`` does not run."""

TRAIN_RUN_TIMEOUT_S = 240
"""Seconds the training run may take before the step fails."""
GPU_TESTS_TIMEOUT_S = 240
"""Seconds ``pytest -m gpu`` may take before the step fails."""

PUSH_SIZES = ("1m", "10m", "50m", "1b")
"""``--push-size``: an embedded preset, or ``1b``: :func:`push_config`'s 0.97 B-parameter Qwen3-MoE."""


@dataclass(frozen=True)
class Environment:
    """What this machine offers the check.

    Attributes:
        python, torch: versions. cuda_build: the CUDA torch was built for (None: a CPU build).
        cuda: whether torch sees a CUDA device; absent: why not, in words (empty when it does).
        devices: the visible CUDA devices' names. capability: the first one's compute capability
            (``"9.0"``). bf16: it computes bf16. nccl: torch.distributed has NCCL.
        memory_gib: the first device's memory. tests: the source checkout's tests/ folder
            (empty: an installed package). pytest: its version (empty: not installed).
    """

    python: str
    torch: str
    cuda_build: str | None
    cuda: bool
    absent: str
    devices: tuple[str, ...] = ()
    capability: str = ""
    bf16: bool = False
    nccl: bool = False
    memory_gib: float = 0.0
    tests: str = ""
    pytest: str = ""


def environment() -> Environment:
    """This machine's :class:`Environment` (imports torch; initialises no CUDA context beyond
    reading the devices' properties)."""
    import torch
    import torch.distributed as dist

    from replayrl.actors.device import cuda_absent_reason

    cuda = torch.cuda.is_available()
    devices, capability, memory = (), "", 0.0
    if cuda:
        devices = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        props = torch.cuda.get_device_properties(0)
        capability, memory = f"{props.major}.{props.minor}", props.total_memory / 2 ** 30
    tests = Path(__file__).resolve().parents[2] / "tests"
    try:
        import pytest

        pytest_version = pytest.__version__
    except ImportError:
        pytest_version = ""
    return Environment(
        python=platform.python_version(), torch=torch.__version__, cuda_build=torch.version.cuda,
        cuda=cuda, absent=cuda_absent_reason(), devices=devices, capability=capability,
        bf16=cuda and torch.cuda.is_bf16_supported(), nccl=dist.is_available() and dist.is_nccl_available(),
        memory_gib=memory, tests=str(tests) if (tests / "conftest.py").is_file() else "",
        pytest=pytest_version)


@dataclass(frozen=True)
class PlannedStep:
    """One step of the check as planned: ``runs``, or skipped for ``why``; ``budget_s`` its
    time budget on one H100 (0 when skipped)."""

    name: str
    what: str
    runs: bool
    why: str
    budget_s: int


def plan(env: Environment, device: str, selected: Sequence[str] = tuple(STEPS)) -> list[PlannedStep]:
    """The steps of :data:`STEPS` on ``env`` for ``--device device`` (``"cuda"`` or ``"cpu"``):
    each runs unless it is not in ``selected``, it needs a CUDA device and ``device`` is cuda
    where ``env`` has none, or it needs the source checkout's tests and pytest (``gpu-tests``,
    which also needs a CUDA device: on the CPU every gpu test skips).

    Raises:
        ValueError: ``device`` is not cpu or cuda, or ``selected`` names no step of :data:`STEPS`.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    unknown = sorted(set(selected) - set(STEPS))
    if unknown:
        raise ValueError(f"no such step(s) {unknown}; the steps are {', '.join(STEPS)}")
    out = []
    for name, (what, budget) in STEPS.items():
        why = ""
        if name not in selected:
            why = SKIPPED
        elif (device == "cuda" or name == "gpu-tests") and not env.cuda:
            why = f"needs a CUDA device: {env.absent}" if device == "cuda" else (
                "the gpu tests need a CUDA device (--device cpu: they would all skip)")
        elif name == "gpu-tests" and not env.tests:
            why = "no tests/ folder beside the package (an installed wheel, not a checkout)"
        elif name == "gpu-tests" and not env.pytest:
            why = "pytest is not installed"
        out.append(PlannedStep(name, what, not why, why, budget if not why else 0))
    return out


_GPU_TESTS = re.compile(r"^(?:\s*@pytest\.mark\.gpu\b|pytestmark = .*pytest\.mark\.gpu\b|"
                        r"from tests\.devices import)", re.MULTILINE)


def gpu_test_files(tests: Path) -> list[str]:
    """The test files under ``tests`` (relative to its parent, sorted) that hold tests marked
    ``gpu``: a line that marks a test or the module (``@pytest.mark.gpu``, ``pytestmark =
    pytest.mark.gpu``) or imports ``tests.devices`` (its CUDA parameter is marked)."""
    return sorted(str(p.relative_to(tests.parent)) for p in tests.rglob("test_*.py")
                  if _GPU_TESTS.search(p.read_text()))


def describe(env: Environment, device: str, steps: list[PlannedStep]) -> str:
    """The dry run's text: the environment, then one line per step (runs / skip and why), then
    the total budget."""
    cuda = (f"{len(env.devices)} x {env.devices[0]} (compute capability {env.capability}, "
            f"{env.memory_gib:.0f} GiB)" if env.cuda else f"absent ({env.absent})")
    lines = [
        f"replayrl bench gpu --device {device}: the plan on this machine",
        f"  python {env.python}, torch {env.torch} "
        f"({'CUDA ' + env.cuda_build + ' build' if env.cuda_build else 'CPU-only build'})",
        f"  CUDA: {cuda}",
        f"  bf16: {'yes' if env.bf16 else 'no'}, NCCL: {'yes' if env.nccl else 'no'}",
        f"  tests: {env.tests or 'none (not a source checkout)'}"
        f"{', pytest ' + env.pytest if env.pytest else ', no pytest'}",
        "steps:",
    ]
    width = max(map(len, STEPS))
    for s in steps:
        state = f"runs, budget {s.budget_s} s" if s.runs else f"skip: {s.why}"
        lines.append(f"  {s.name:<{width}}  {state}\n  {'':<{width}}  ({s.what})")
    total = sum(s.budget_s for s in steps)
    lines.append(f"{sum(s.runs for s in steps)} of {len(steps)} steps run; budget {total} s "
                 f"({total / 60:.1f} min) of a 10-minute device call")
    if not env.cuda:
        on_gpu = plan(replace(env, cuda=True, absent=""), "cuda", [s.name for s in steps if s.why != SKIPPED])
        gpu_total = sum(s.budget_s for s in on_gpu)
        lines.append(f"on a CUDA machine --device cuda: {sum(s.runs for s in on_gpu)} steps, budget "
                     f"{gpu_total} s ({gpu_total / 60:.1f} min)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the steps


def push_config(size: str, vocab_size: int):
    """The model of the push step: the embedded preset ``size``, or for ``"1b"`` a Qwen3-MoE of
    974,919,680 parameters at 44 tokens (hidden 2048, 16 layers: layer 0 dense of width 8192,
    15 MoE layers of 8 experts of width 1024 top-2, 16 query heads x 128, 4 KV heads, the
    indexer on layers 1, 5, 9 and 13).

    Raises:
        ValueError: ``size`` is not one of :data:`PUSH_SIZES`.
    """
    from replayrl.rollout.model.config import embedded_config

    if size not in PUSH_SIZES:
        raise ValueError(f"--push-size must be one of {', '.join(PUSH_SIZES)}, got {size!r}")
    if size != "1b":
        return embedded_config(vocab_size, size)
    return replace(embedded_config(vocab_size, "50m"), hidden_size=2048, intermediate_size=8192,
                   moe_intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=128, index_layers=(1, 5, 9, 13))


@dataclass
class StepResult:
    """What one step gave: ``ok`` (it ran and its checks held), its figures, its seconds and
    peak memory (MiB: the device's ``max_memory_allocated`` on CUDA, the process's peak RSS on
    the CPU), and the error (a traceback) when it raised."""

    name: str
    ok: bool
    seconds: float
    peak_mib: float
    figures: dict = field(default_factory=dict)
    error: str = ""


class GpuCheck:
    """The steps of the check on one device, sharing the checkpoints and samples they build.

    Args:
        device: ``"cuda"`` or ``"cpu"`` (``--device``).
        model_size: the embedded model of the parity, generation and trainer steps and of the
            training run (``--model-size``).
        push_size: the push step's model (:data:`PUSH_SIZES`).
        output_dir: checkpoints, the training run and ``gpu.json`` go here.
        seed: weights, prompts and sampling.
        train_steps: optimizer steps of the training run.
    """

    def __init__(self, device: str, model_size: str, push_size: str, output_dir: Path,
                 seed: int = 1, train_steps: int = 20) -> None:
        import torch

        from replayrl.actors.device import process_device

        self.kind = device
        self.device = process_device(device)
        self.model_size, self.push_size = model_size, push_size
        self.output_dir, self.seed, self.train_steps = output_dir, seed, train_steps
        self._checkpoints: dict[str, Path] = {}
        self._samples: dict[str, list] = {}
        self.torch = torch

    # -- shared pieces ------------------------------------------------------------------------
    def checkpoint(self, size: str) -> Path:
        """The embedded model of ``size`` (seeded) written once as an HF checkpoint."""
        if size not in self._checkpoints:
            from replayrl.tools.run.from_flags import build_config
            from replayrl.tools.run.launcher import write_initial_checkpoint

            path = self.output_dir / f"checkpoint-{size}"
            config = build_config({"model-size": size, "seed": self.seed})
            self._checkpoints[size] = write_initial_checkpoint(config, path)
        return self._checkpoints[size]

    def engine(self, size: str, dtype: str):
        """An embedded engine on the device in ``dtype``, loaded with the ``size`` checkpoint."""
        from replayrl.rollout.engines.embedded import EmbeddedEngine
        from replayrl.rollout.model.checkpoint import state_dict_arrays
        from replayrl.rollout.model.loader import load_pretrained

        model, config = load_pretrained(self.checkpoint(size), dtype=self.torch.float32)
        engine = EmbeddedEngine(config, dtype=dtype, device=self.device)
        engine.load_weights(state_dict_arrays(model), version=0)
        return engine

    def samples(self, size: str, prompts: int = 64, response_len: int = 16) -> list:
        """Trajectories the bf16 engine generated for the digit task (every trace captured)."""
        if size not in self._samples:
            from replayrl.rollout.sample import TRACE_FIELDS, Sample
            from replayrl.rollout.sampling.sampling_params import SamplingParams
            from replayrl.rollout.tasks.digit_puzzle import DigitTask
            from replayrl.rollout.tasks.digits import digit_task_prompts
            from replayrl.rollout.text.data_source import PromptDataSource
            from replayrl.rollout.traces.trajectory import merge_turns

            engine = self.engine(size, "bfloat16")
            task = DigitTask(num_digits=8)  # longer prompts: the indexer drops keys
            batch = PromptDataSource(digit_task_prompts(task, self.seed, prompts), self.seed).next_batch(prompts)
            gens = engine.generate([p.prompt_ids.tolist() for p in batch], SamplingParams(top_k=20),
                                   max_new_tokens=response_len, eos_token_id=task.eos_id,
                                   seed=self.seed, traces=TRACE_FIELDS)
            out = []
            for i, (p, g) in enumerate(zip(batch, gens)):
                fields = merge_turns(p.prompt_ids, [g], [], sample_id=i).sample_fields()
                out.append(Sample(sample_id=i, group_id=i // 4, rollout_id=0, policy_version=0,
                                  prompt_ids=p.prompt_ids, **fields))
            self._samples[size] = out
        return self._samples[size]

    def backend(self, size: str, name: str = "torch", **settings):
        """The ``name`` trainer backend on the device, from the ``size`` checkpoint."""
        from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
        from replayrl.trainer.backends import resolve_backend
        from replayrl.trainer.config import TrainerConfig

        config = TrainerConfig(device=self.kind, train_backend=name, **settings)
        return resolve_backend(name)(str(self.checkpoint(size)), config, list(VOCABULARY))

    def batch(self, size: str):
        """The :meth:`samples` of ``size`` as one training batch with every trace."""
        from replayrl.trainer.batching.batch import collate

        return collate(self.samples(size), routing=True, indexer=True, support=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    # -- the steps ----------------------------------------------------------------------------
    def placement(self) -> dict:
        """Where the torch and fsdp trainers keep weights and AdamW moments, where the engine
        keeps its weights and KV cache, and whether the proximal cache pins (the 1m model)."""
        from replayrl.rollout.engines.embedded import _Forward, _PaddedBatch, _prefill
        from replayrl.trainer.ranks.proximal_cache import ProximalLogprobCache

        figures, want = {}, self.device.type
        for name in ("torch", "fsdp"):
            backend = self.backend("1m", name)
            backend.zero_grad()
            backend.forward_backward(self.batch("1m"), lambda logp: -logp.sum())
            backend.clip_and_step(1.0)
            local = lambda t: t.to_local() if hasattr(t, "to_local") else t
            figures[f"{name}_weights"] = sorted({local(p).device.type for p in backend.model.parameters()})
            figures[f"{name}_optimizer"] = sorted({local(v).device.type for s in backend.optimizer.state.values()
                                                   for k, v in s.items() if k.startswith("exp_avg")})
            figures[f"{name}_compute_dtype"] = str(getattr(backend, "compute_dtype", None))
        engine = self.engine("1m", "bfloat16")
        forward = _Forward(engine.model, True, True)
        _prefill(forward, _PaddedBatch([[5, 9, 3, 7]], engine.device))
        figures["engine_weights"] = sorted({p.device.type for p in engine.model.parameters()})
        figures["kv_cache"] = sorted({t.device.type for t in forward.cache._keys if t is not None})
        cache = ProximalLogprobCache(device=self.device)
        cache.put(0, self.torch.zeros(3, device=self.device))
        figures["proximal_cache_pinned"] = cache.pinned and cache.take([0])[0].is_pinned()
        places = [v for k, v in figures.items() if isinstance(v, list)]
        figures["ok"] = all(v == [want] for v in places) and figures["proximal_cache_pinned"] == (want == "cuda")
        return figures

    def parity(self) -> dict:
        """The bf16 engine's trajectories recomputed by the trainer (bf16 autocast on CUDA) with
        routing, indexer and support replay on: the choices it used against the engine's (flips,
        must be 0), its own choices (drift) and ``|logp_trainer - logp_rollout|``."""
        from replayrl.trainer.replay.checks import batch_flip_rate

        backend = self.backend(self.model_size)
        batch = self.batch(self.model_size)
        out = backend.preflight_logprobs(batch)
        mask = batch.sampled_mask > 0
        r = (out.logprobs - batch.rollout_logprobs)[mask].double()
        rate = lambda engine, other: batch_flip_rate(engine, other, batch.key_padding_mask)
        figures = {
            "samples": len(self.samples(self.model_size)),
            "compute_dtype": str(backend.compute_dtype),
            "routing_flips": rate(batch.routed_experts, out.routed_experts),
            "indexer_flips": rate(batch.indexer_topk, out.indexer_topk),
            "routing_drift": rate(batch.routed_experts, out.own_routed_experts),
            "indexer_drift": rate(batch.indexer_topk, out.own_indexer_topk),
            "mean_abs_dlogp": float(r.abs().mean()), "max_abs_dlogp": float(r.abs().max()),
            "k3_kl": float((r.exp() - 1 - r).mean()),
        }
        flips = [figures["routing_flips"], figures["indexer_flips"]]
        figures["ok"] = all(f == 0 or math.isnan(f) for f in flips) and math.isfinite(figures["mean_abs_dlogp"])
        return figures

    def push(self) -> dict:
        """A weight push of the ``--push-size`` model: the fp32 weights concatenated on the
        device and copied once to a host buffer (the torch backend's pack), then loaded into an
        engine on the device in its dtype (cast on the device's side of the copy); twice, the
        second timed as the steady figure. The transport between processes is not in it (the
        training run's ``weight_push_seconds`` has it)."""
        import numpy as np

        from replayrl.rollout.engines.embedded import EmbeddedEngine
        from replayrl.rollout.engines.precision import resolve_dtype
        from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
        from replayrl.rollout.tasks.digit_puzzle import VOCABULARY

        torch = self.torch
        config = push_config(self.push_size, len(VOCABULARY))
        model = Qwen3MoeForCausalLM.empty(config, torch.float32, self.device)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        dtype = resolve_dtype("auto", self.device)
        engine = EmbeddedEngine(config, dtype=dtype, device=self.device)
        state = model.state_dict()
        numel = sum(t.numel() for t in state.values())
        buffer = np.empty(numel, np.float32)
        times = []
        for version in range(2):
            self._sync()
            start = time.perf_counter()
            with torch.no_grad():
                torch.from_numpy(buffer).copy_(torch.cat([t.reshape(-1) for t in state.values()]))
            packed = time.perf_counter()
            arrays, offset = {}, 0
            for name, t in state.items():
                arrays[name] = buffer[offset:offset + t.numel()].reshape(t.shape)
                offset += t.numel()
            engine.load_weights(arrays, version=version)
            self._sync()
            times.append((packed - start, time.perf_counter() - packed))
        pack_s, load_s = times[-1]
        probe = next(iter(state))
        same = torch.equal(engine.model.state_dict()[probe].float().cpu(),
                           state[probe].to(dtype=getattr(torch, dtype)).float().cpu())
        return {"parameters": numel, "gigabytes": numel * 4 / 1e9, "engine_dtype": dtype,
                "pack_seconds": pack_s, "load_seconds": load_s, "push_seconds": pack_s + load_s,
                "first_push_seconds": sum(times[0]), "gb_per_second": numel * 4 / 1e9 / (pack_s + load_s),
                "ok": same}

    def generation(self, batch: int = 64, response_len: int = 64, calls: int = 3) -> dict:
        """Response tokens per second of the embedded engine on the device in its ``auto``
        dtype (one warm-up call, then ``calls`` timed), every trace captured."""
        from replayrl.rollout.engines.precision import resolve_dtype
        from replayrl.rollout.sample import TRACE_FIELDS
        from replayrl.rollout.sampling.sampling_params import SamplingParams
        from replayrl.rollout.tasks.digit_puzzle import DigitTask
        from replayrl.rollout.tasks.digits import digit_task_prompts
        from replayrl.rollout.text.data_source import PromptDataSource

        dtype = resolve_dtype("auto", self.device)
        engine = self.engine(self.model_size, dtype)
        task = DigitTask()
        data = PromptDataSource(digit_task_prompts(task, self.seed, batch * (calls + 1)), self.seed)
        tokens, seconds = 0, 0.0
        for k in range(calls + 1):
            prompts = [p.prompt_ids.tolist() for p in data.next_batch(batch)]
            start = time.perf_counter()
            gens = engine.generate(prompts, SamplingParams(top_k=20), max_new_tokens=response_len,
                                   eos_token_id=task.eos_id, seed=self.seed + k, traces=TRACE_FIELDS)
            if k:  # the first call warms the kernels up
                seconds += time.perf_counter() - start
                tokens += sum(len(g.response_ids) for g in gens)
        return {"engine_dtype": dtype, "batch": batch, "response_tokens": tokens,
                "tokens_per_second": tokens / seconds, "ok": tokens > 0}

    def trainer(self, updates: int = 5) -> dict:
        """Forwarded tokens per second of full updates (forward, backward, clip and AdamW step)
        of the torch backend on the device over the parity step's batch (one warm-up update)."""
        backend = self.backend(self.model_size)
        batch = self.batch(self.model_size)
        tokens = int(batch.key_padding_mask.sum())
        norms, seconds = [], 0.0
        for k in range(updates + 1):
            start = time.perf_counter()
            backend.zero_grad()
            backend.forward_backward(batch, lambda logp: -logp.mean())
            norms.append(backend.clip_and_step(1.0))  # a float: waits for the device
            if k:
                seconds += time.perf_counter() - start
        return {"compute_dtype": str(backend.compute_dtype), "tokens_per_update": tokens,
                "updates": updates, "tokens_per_second": tokens * updates / seconds,
                "ok": all(math.isfinite(n) for n in norms)}

    def train_run(self) -> dict:
        """``replayrl train --device DEVICE`` for :attr:`train_steps` steps of the
        ``--model-size`` model in a child process (the launcher, its actors, the weight pushes
        between processes); reads its metrics: every step's routing / indexer flips must be 0."""
        out = self.output_dir / "train-run"
        argv = [sys.executable, "-m", "replayrl.tools.cli", "train", "--device", self.kind,
                "--model-size", self.model_size, "--num-steps", str(self.train_steps),
                "--seed", str(self.seed), "--no-progress", "--output-dir", str(out),
                "--overwrite"]  # a check run again replaces its earlier train run
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TRAIN_RUN_TIMEOUT_S)
        figures: dict[str, Any] = {"command": " ".join(argv[2:]), "returncode": proc.returncode,
                                   "wall_seconds": time.perf_counter() - start,
                                   "output_tail": (proc.stdout + proc.stderr)[-2000:]}
        metrics = out / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        median = lambda key: statistics.median(r[key] for r in rows if r.get(key) is not None) if any(
            r.get(key) is not None for r in rows) else None
        worst = lambda key: max((r[key] for r in rows if r.get(key) is not None), default=None)
        figures.update(steps=len(rows), step_seconds=median("step_seconds"),
                       weight_push_seconds=median("weight_push_seconds"),
                       routing_flip_rate_max=worst("routing_flip_rate"),
                       indexer_flip_rate_max=worst("indexer_flip_rate"),
                       reward_last=rows[-1].get("reward_mean") if rows else None)
        figures["ok"] = (proc.returncode == 0 and len(rows) == self.train_steps
                         and not figures["routing_flip_rate_max"] and not figures["indexer_flip_rate_max"])
        return figures

    def gpu_tests(self) -> dict:
        """``pytest -m gpu`` over the source checkout's test files that hold gpu tests
        (:func:`gpu_test_files`: the others are not even collected, so a test dependency the
        device lacks costs nothing), its summary line and status."""
        root = Path(__file__).resolve().parents[2]
        files = gpu_test_files(root / "tests")
        argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=GPU_TESTS_TIMEOUT_S)
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        return {"command": " ".join(argv[2:]), "returncode": proc.returncode,
                "wall_seconds": time.perf_counter() - start,
                "summary": lines[-1] if lines else "", "output_tail": (proc.stdout + proc.stderr)[-3000:],
                "ok": proc.returncode == 0}

    def run_step(self, name: str) -> StepResult:
        """Run step ``name``; its failure (an exception, or a check that did not hold) is
        recorded in the result, never raised."""
        steps: dict[str, Callable[[], dict]] = {
            "placement": self.placement, "parity": self.parity, "push": self.push,
            "generation": self.generation, "trainer": self.trainer, "train-run": self.train_run,
            "gpu-tests": self.gpu_tests}
        cuda = self.device.type == "cuda"
        if cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            figures, error = steps[name](), ""
        except Exception:  # a step's failure is its result: the others still run
            figures, error = {"ok": False}, traceback.format_exc()
        seconds = time.perf_counter() - start
        if cuda:  # what this process cached goes back before the next step (the training run's
            gc.collect()  # processes share the device)
            self.torch.cuda.empty_cache()
        peak = (self.torch.cuda.max_memory_allocated(self.device) if cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2 ** 20
        ok = bool(figures.pop("ok", False)) and not error
        return StepResult(name, ok, seconds, peak, figures, error)


def _compute(dtype: str) -> str:
    """A backend's ``compute_dtype`` as the table shows it."""
    return "bf16 autocast" if dtype == "torch.bfloat16" else "fp32"


HEADLINES = {
    "placement": lambda f: f"weights: torch {f['torch_weights']}, fsdp {f['fsdp_weights']}, engine "
                           f"{f['engine_weights']}; KV cache {f['kv_cache']}; proximal cache pinned "
                           f"{f['proximal_cache_pinned']}",
    "parity": lambda f: f"flips: routing {f['routing_flips']:.4f}, indexer {f['indexer_flips']:.4f}; "
                        f"mean abs dlogp {f['mean_abs_dlogp']:.2e}; trainer {_compute(f['compute_dtype'])}",
    "push": lambda f: f"{f['parameters']:,} parameters: {f['push_seconds']:.3f} s (pack "
                      f"{f['pack_seconds']:.3f}, load {f['load_seconds']:.3f}; {f['gb_per_second']:.1f} GB/s)",
    "generation": lambda f: f"{f['tokens_per_second']:,.0f} tokens/s ({f['engine_dtype']})",
    "trainer": lambda f: f"{f['tokens_per_second']:,.0f} tokens/s ({_compute(f['compute_dtype'])})",
    "train-run": lambda f: f"{f['steps']} steps, exit {f['returncode']}; median step "
                           f"{f['step_seconds']:.3f} s, push {f['weight_push_seconds']:.3f} s; "
                           f"max flips {f['routing_flip_rate_max']} / {f['indexer_flip_rate_max']}",
    "gpu-tests": lambda f: f"{f['summary']}",
}
"""Step name -> the table's one-line summary of its figures."""


def headline(result: StepResult) -> str:
    """The table cell of a step: its summary line, or the last line of its error."""
    if result.error:
        return result.error.strip().splitlines()[-1][:160]
    try:
        return HEADLINES[result.name](result.figures)
    except (KeyError, TypeError, ValueError):  # a figure missing: show them raw
        return strict_json.dumps(strict_json.finite_or_none(result.figures), default=str)[:160]


def report(results: list[StepResult], skipped: list[PlannedStep]) -> str:
    """Markdown table of the steps that ran and those skipped."""
    lines = ["| step | result | seconds | peak MiB | figures |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {'ok' if r.ok else 'FAILED'} | {r.seconds:.1f} | "
                     f"{r.peak_mib:,.0f} | {headline(r)} |")
    for s in skipped:
        lines.append(f"| {s.name} | skipped | | | {s.why} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: the dry run's plan, or the steps' table (and ``gpu.json``)."""
    parser = bench_parser("gpu", __doc__)
    parser.add_argument("--dry-run", action="store_true",
                        help="check the environment and print the plan; run nothing, exit 0")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="where the steps run (cpu: the same steps on the CPU, as CI runs them)")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help="the steps to run, comma-separated, in their fixed order")
    parser.add_argument("--model-size", default="10m", choices=("1m", "10m", "50m"),
                        help="embedded model of the parity, generation, trainer and training-run steps")
    parser.add_argument("--push-size", default="1b", choices=PUSH_SIZES,
                        help="model of the push step (1b: 0.97 B parameters)")
    parser.add_argument("--train-steps", type=int, default=20, help="steps of the training run (>= 1)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the weights, prompts and sampling")
    parser.add_argument("--output-dir", default="runs/gpu", help="checkpoints, the training run and gpu.json")
    args = parser.parse_args(argv)
    if args.train_steps < 1:
        parser.error("--train-steps must be >= 1")
    selected = [s.strip() for s in args.steps.split(",") if s.strip()]
    env = environment()
    try:
        steps = plan(env, args.device, selected)
    except ValueError as exc:
        parser.error(str(exc))
    print(describe(env, args.device, steps), flush=True)
    if args.dry_run:
        return 0
    if args.device == "cuda" and not env.cuda:
        print(f"replayrl bench gpu: no CUDA device ({env.absent}); --dry-run prints the plan, "
              f"--device cpu runs the steps on the CPU", file=sys.stderr)
        return 2
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    check = GpuCheck(args.device, args.model_size, args.push_size, output, args.seed, args.train_steps)
    results = []
    for step in (s for s in steps if s.runs):
        results.append(check.run_step(step.name))
        r = results[-1]
        print(f"[{r.name}] {'ok' if r.ok else 'FAILED'} in {r.seconds:.1f} s: {headline(r)}", flush=True)
        if r.error:
            print(r.error, file=sys.stderr, flush=True)
    skipped = [s for s in steps if not s.runs]
    print(report(results, skipped))
    record = {"environment": asdict(env), "device": args.device, "model_size": args.model_size,
              "push_size": args.push_size, "plan": [asdict(s) for s in steps],
              "results": [asdict(r) for r in results]}
    path = output / "gpu.json"
    # strict JSON as every file a run writes: a figure with no finite value is null
    path.write_text(strict_json.dumps(strict_json.finite_or_none(record), indent=1, default=str) + "\n")
    print(f"figures: {path}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
