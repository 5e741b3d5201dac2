"""``replayrl bench limit``: how far a replayrl step is from the machine's limit.

At each grid point (:mod:`replayrl.tools.bench.peer_grid`'s ``SIZES:LENGTHS``) it measures, in
this one process with no actor, socket or shared memory in between:

* **generation alone**: the embedded engine generating one step's batch
  (``rollout-batch-size`` prompts x ``n-samples-per-prompt``, the run's sampling, the traces the
  trainer replays) on ``--engine-torch-threads`` threads;
* **training alone**: the trainer's update on those samples (the run's backend, loss and
  replays; :meth:`replayrl.trainer.ranks.trainer_actor.TrainerActor._update`) on the trainer's
  threads, the new weights then loaded into the engine (not timed) so the next batch comes from
  the trained policy, as in a run;

then runs ``replayrl train`` itself twice at the same settings: asynchronous (the default, one
step stale) and ``--max-staleness 0`` (generate, then train). Each figure is the median over the
steps after the first ``--warmup``. The limit of the asynchronous step is the larger of the two
alone (generation and training overlap), of the synchronous one their sum; the report prints
each step against its limit and the run's own median seconds of what is neither (weight push,
transport, waits; ``metrics.jsonl`` keys).

The larger of the two assumes each side has cores of its own. Where they share too few, the
overlap is bound by the CPU both need instead: the **core bound** is the CPU seconds
(``time.process_time``, every thread of this process, OpenMP's spin-waits included) of
generation alone plus those of training alone, over the cores this process may run on
(``os.sched_getaffinity``). The report prints the asynchronous step against the larger of the
three as well: a step at 1.0 there is at the machine's limit, whatever the target column says.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from replayrl.tools.bench.peer import launch_rows, prompt_stream, run_config
from replayrl.tools.bench.peer_grid import GridPoint, parse_grid
from replayrl.tools.bench.usage import bench_parser
from replayrl.tools.errors import BenchError

REST_KEYS = ("weight_push_seconds", "transport_seconds", "preflight_seconds",
             "wait_for_rollout_seconds", "wait_for_trainer_seconds")
"""``metrics.jsonl`` keys of a run's step that are neither generation nor the update."""


@dataclass(frozen=True)
class LimitRow:
    """One point's medians (seconds): generation alone, training alone, the asynchronous and
    the synchronous step of a real run, and the asynchronous run's :data:`REST_KEYS`;
    ``generate_cpu`` / ``train_cpu``: the CPU seconds of the two alone (medians, every thread);
    ``cores``: the cores they ran on."""

    point: GridPoint
    generate: float
    train: float
    async_step: float
    sync_step: float
    rest: dict
    generate_cpu: float
    train_cpu: float
    cores: int

    @property
    def core_bound(self) -> float:
        """(generation's + training's CPU seconds) / cores: the shortest an overlapped step can
        be when both share the machine's cores (module docstring)."""
        return (self.generate_cpu + self.train_cpu) / self.cores

    @property
    def bound_ratio(self) -> float:
        """Asynchronous step / max(generation, training, :attr:`core_bound`)."""
        return self.async_step / max(self.generate, self.train, self.core_bound)

    @property
    def async_ratio(self) -> float:
        """Asynchronous step / max(generation, training): 1.0 is the overlap's limit."""
        return self.async_step / max(self.generate, self.train)

    @property
    def sync_ratio(self) -> float:
        """Synchronous step / (generation + training): 1.0 is the sequential limit."""
        return self.sync_step / (self.generate + self.train)


def steady_median(values: Sequence[float], warmup: int) -> float:
    """Median of ``values`` after the first ``warmup``.

    Raises:
        BenchError: no value is left.
    """
    kept = list(values)[warmup:]
    if not kept:
        raise BenchError(f"{len(values)} steps leave none after --warmup {warmup}")
    return statistics.median(kept)


def _rewards(config, tokenizer, prompts, responses) -> list[float]:
    """The run's task's reward of each response (one prompt per ``n`` responses, in order),
    through the task's own verifier as the rollout manager calls it (one turn: loss mask 1)."""
    import numpy as np

    from replayrl.rollout.tasks import make_task

    task, n = make_task(config.rollout), config.rollout.n_samples_per_prompt
    calls = [task.reward(tokenizer, prompts[i // n], np.asarray(r, np.int32),
                         np.ones(len(r), np.uint8)) for i, r in enumerate(responses)]
    return [float(c.fn(*c.args)) for c in calls]


def alone(config, steps: int, work: Path) -> tuple[list[float], list[float], list[float], list[float]]:
    """``(generation seconds, training seconds, generation CPU seconds, training CPU seconds)``
    per step, engine and trainer in this process (CPU: ``time.process_time``, every thread).

    Raises:
        BenchError: the run's engine is not the embedded one, or its step needs a preflight.
    """
    import torch

    from replayrl.rollout.engines.embedded import EmbeddedEngine
    from replayrl.rollout.engines.precision import resolve_dtype
    from replayrl.rollout.model.checkpoint import state_dict_arrays
    from replayrl.rollout.sample import Sample
    from replayrl.rollout.sampling.sampling_params import SamplingParams
    from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
    from replayrl.rollout.text.tokenizer import load_tokenizer
    from replayrl.rollout.traces.trajectory import merge_turns
    from replayrl.tools.run.launcher import write_initial_checkpoint
    from replayrl.trainer.ranks.trainer_actor import TrainerActor

    if config.rollout_engine != "embedded":
        raise BenchError("bench limit measures the embedded engine")
    r, t = config.rollout, config.trainer
    checkpoint = write_initial_checkpoint(config, work / "checkpoint-init")
    torch.set_num_threads(t.torch_threads)
    trainer = TrainerActor(str(checkpoint), t.to_dict(), n_samples_per_prompt=r.n_samples_per_prompt,
                           engines=[], rollout_batch_size=r.rollout_batch_size,
                           vocab_tokens=list(VOCABULARY))
    if trainer.needs_preflight():  # an RS gate or refill: rounds with the manager, not one update
        raise BenchError("bench limit measures the default update (no RS gate, refill or "
                         "--preflight always)")
    model = trainer.backend.model
    engine = EmbeddedEngine(config.policy_config, dtype=resolve_dtype(config.engine_dtype))
    engine.load_weights(state_dict_arrays(model), version=0)
    traces = frozenset(trainer.required_traces)  # what the trainer replays, as engines capture
    stream = prompt_stream(config, checkpoint)
    n, b = r.n_samples_per_prompt, r.rollout_batch_size
    tokenizer = load_tokenizer(checkpoint)
    eos = int(tokenizer.eos_token_id)
    generate, train, generate_cpu, train_cpu = [], [], [], []
    for step in range(steps):
        prompts = stream[step * b:(step + 1) * b]
        torch.set_num_threads(config.engine_torch_threads)
        start, cpu = time.perf_counter(), time.process_time()
        gens = engine.generate([[int(x) for x in p.prompt_ids] for p in prompts for _ in range(n)],
                               SamplingParams(**r.sampling_dict()), max_new_tokens=r.max_response_len,
                               eos_token_id=eos, seed=r.seed + step, traces=traces)
        generate.append(time.perf_counter() - start)
        generate_cpu.append(time.process_time() - cpu)
        rewards = _rewards(config, tokenizer, prompts, [g.response_ids for g in gens])
        samples = [Sample(sample_id=step * b * n + i, group_id=step * b + i // n, rollout_id=step,
                          policy_version=step, prompt_ids=prompts[i // n].prompt_ids,
                          reward=float(rewards[i]),
                          **merge_turns(prompts[i // n].prompt_ids, [g], (), sample_id=i,
                                        require=traces).sample_fields())
                   for i, g in enumerate(gens)]
        torch.set_num_threads(t.torch_threads)
        accept = {s.sample_id: torch.ones(len(s.response_ids), dtype=torch.bool) for s in samples}
        start, cpu = time.perf_counter(), time.process_time()
        asyncio.run(trainer._update(samples, accept, fused=True))
        train.append(time.perf_counter() - start)
        train_cpu.append(time.process_time() - cpu)
        engine.load_weights(state_dict_arrays(model), version=step + 1)
    return generate, train, generate_cpu, train_cpu


def measure(point: GridPoint, steps: int, warmup: int, work: Path, overrides: dict) -> LimitRow:
    """:class:`LimitRow` of one point: alone in this process, then the two real runs."""
    values = {**overrides, **point.overrides()}
    gen, train, gen_cpu, train_cpu = alone(run_config(steps, 1, str(work / "alone"), values), steps, work)
    runs = {name: launch_rows(run_config(steps, 1, str(work / name), {**values, **extra}))
            for name, extra in (("async", {}), ("sync", {"max-staleness": 0}))}
    rows = runs["async"]
    rest = {k: steady_median([row.get(k) or 0.0 for row in rows], warmup) for k in REST_KEYS}
    return LimitRow(point, steady_median(gen, warmup), steady_median(train, warmup),
                    steady_median([row["step_seconds"] for row in rows], warmup),
                    steady_median([row["step_seconds"] for row in runs["sync"]], warmup), rest,
                    steady_median(gen_cpu, warmup), steady_median(train_cpu, warmup),
                    len(os.sched_getaffinity(0)))


def table(rows: Sequence[LimitRow]) -> str:
    """Markdown table: the four medians, both ratios to their limits, the core bound and the
    asynchronous step against the larger of the three, and the rest."""
    head = ("| point | generation alone | training alone | async step | / max (target <= 1.15) "
            "| sync step | / sum (target <= 1.10) | CPU s alone: (gen + train) / cores | core bound "
            "| async / max(gen, train, core bound) | "
            + " | ".join(k.removesuffix("_seconds") for k in REST_KEYS) + " |")
    lines = [head, "|---" + "|---:" * (head.count("|") - 2) + "|"]
    for r in rows:
        lines.append(f"| {r.point.model_size} x {r.point.answer_tokens} | {r.generate:.3f} | "
                     f"{r.train:.3f} | {r.async_step:.3f} | {r.async_ratio:.2f} | "
                     f"{r.sync_step:.3f} | {r.sync_ratio:.2f} | "
                     f"({r.generate_cpu:.3f} + {r.train_cpu:.3f}) / {r.cores} | {r.core_bound:.3f} | "
                     f"{r.bound_ratio:.2f} | "
                     + " | ".join(f"{r.rest[k]:.3f}" for k in REST_KEYS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: prints the table (seconds, medians over the steady steps)."""
    parser = bench_parser("limit", __doc__)
    parser.add_argument("--grid", default="1m:2",
                        help="grid points: SIZES:LENGTHS as bench peer --grid, or quick / full")
    parser.add_argument("--steps", type=int, default=20, help="steps per measurement")
    parser.add_argument("--warmup", type=int, default=5,
                        help="first steps of each measurement left out of the medians")
    parser.add_argument("--trainer-backward-threads", type=int, default=None, metavar="N",
                        help="replayrl train's --trainer-backward-threads at every point "
                             "(default: train's own)")
    parser.add_argument("--priority", action="store_true",
                        help="run ahead of other sessions' jobs (Linux autogroup; needs root)")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup or args.warmup < 0:
        parser.error("need 0 <= --warmup < --steps")
    try:
        points = parse_grid(args.grid)
    except BenchError as exc:
        parser.error(str(exc))
    overrides = ({} if args.trainer_backward_threads is None
                 else {"trainer-backward-threads": args.trainer_backward_threads})
    from replayrl.tools.bench.priority import autogroup_priority

    rows = []
    with autogroup_priority(args.priority), tempfile.TemporaryDirectory(prefix="rrl-limit-") as tmp:
        for point in points:
            work = Path(tmp) / f"{point.model_size}-{point.answer_tokens}"
            work.mkdir()
            rows.append(measure(point, args.steps, args.warmup, work, overrides))
            print(f"[limit] {point.model_size} x {point.answer_tokens} done", file=sys.stderr,
                  flush=True)
    print(f"bench limit: medians over steps {args.warmup + 1}-{args.steps} (seconds); generation "
          "and training alone in one process; async / sync: replayrl train and --max-staleness 0\n")
    print(table(rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
