"""Benchmark: support-replay logprobs against full-vocabulary logprobs (not a test).

Three ways to get the per-token logprobs of ``N`` rows from final hidden states ``[N, H]`` and
an LM head ``[V, H]``, each timed forward + backward (``loss = sum(logp)``, gradients into the
hidden states AND the LM head, as in training):

* ``full``   -- ``logits = hidden @ W.T`` ``[N, V]``, then ``full_vocab_logprobs`` (baseline);
* ``gather`` -- the same logits, then ``support_logprobs`` over the captured support
  ``[N, 1 + top_k]`` (gathers ``1 + K`` logits per row);
* ``fused``  -- ``fused_support_logprobs``: projects only the candidate pairs from the hidden
  states in row chunks, never building ``[N, V]``.

Every ``eos_every``-th row is a synthetic-EOS row (no captured support: full-vocabulary
fallback through the fixed one-slot-per-trajectory ``fallback_rows``), so the support paths do
their full-vocabulary work too; on those rows (and on every row when ``top_k == vocab``) the
support is the whole vocabulary, and each path's logprob and gradient w.r.t. the hidden state
are compared with a float64 full-vocabulary reference computed in the same process.

Peak memory. On CPU torch has no allocator counters (``torch.cuda.max_memory_allocated`` has no
CPU twin, tracemalloc does not see torch's allocations, and the profiler's CPU memory events are
incomplete). Each (path, N) runs in a fresh Python process instead: inputs are built, one tiny
warm-up call initialises the kernels, the peak-RSS mark is reset (``/proc/self/clear_refs``,
Linux), and the reported peak is ``VmHWM`` after the measured call minus ``VmRSS`` before it:
the physical memory the call added at its worst moment, including the ``[V, H]`` LM-head
gradient every path must produce. glibc returns large freed blocks to the OS, so one fresh
process per configuration keeps earlier configurations out of the number. If the mark cannot be
reset, ``ru_maxrss`` is used (an upper bound that also covers input construction).

Timing: the best (minimum) wall time of up to ``--repeats`` forward + backward calls (the
first of them is the memory-measured call; no further call once ``--repeat-budget`` seconds are
spent, so the largest baselines are timed once), configurations one after another, with
``--threads`` intra-op threads (default 1). On the shared 2-vCPU machines this was written on,
two OpenMP threads made the same fused call take anywhere from 0.2 s to 7 s whenever other load
took a core (every parallel region waits at its barrier for the descheduled thread), while one
thread stayed within 0.35-0.5 s and even ran the full-vocabulary baseline faster (29 s vs
32-44 s at N = 4096). Every path runs with the same threads, so the ratios compare like with
like. The load average before and after the run is printed with the table. Memory does not
depend on threads or load.

Usage: ``replayrl bench logprobs [--tokens 256 1024 4096] [--hidden 256] ...``
(``python -m replayrl.tools.bench.logprobs`` runs the same).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from replayrl.tools.bench.usage import bench_parser
from replayrl.tools.errors import BenchError
from replayrl.trainer.loss.logprobs import full_vocab_logprobs, fused_support_logprobs, support_logprobs
from replayrl.transport import strict_json

__all__ = [ "BenchConfig", "Measurement", "PATHS", "make_inputs", "measure_here",
           "run_bench", "format_table", "add_arguments", "run_from_args", "main"]

PATHS = ("full", "gather", "fused")
_MIB = float(1 << 20)


@dataclass(frozen=True)
class BenchConfig:
    """Sizes of one benchmark run.

    vocab ``V`` and hidden ``H`` of the LM head; top_k ``K`` support candidates per row
    (``K <= V``); temperature ``> 0``; chunk_size rows per fused chunk; eos_every: one
    synthetic-EOS row at the end of every ``eos_every`` rows (0 = none); seed; repeats: most
    timed calls per configuration (>= 1); threads: torch intra-op threads (>= 1); repeat_budget_s:
    no further call once the calls made
    so far took this many seconds (the slowest configurations are timed once).
    """

    vocab: int = 151936
    hidden: int = 256
    top_k: int = 20
    temperature: float = 1.0
    chunk_size: int = 256
    eos_every: int = 64
    seed: int = 0
    repeats: int = 5
    threads: int = 1
    repeat_budget_s: float = 8.0

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "top_k", "chunk_size", "repeats", "threads"):
            if getattr(self, name) < 1:
                raise BenchError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.vocab:
            raise BenchError(f"top_k ({self.top_k}) cannot exceed vocab ({self.vocab})")
        if self.eos_every < 0 or not self.temperature > 0 or not self.repeat_budget_s >= 0:
            raise BenchError("eos_every and repeat_budget_s must be >= 0 and temperature > 0")


@dataclass(frozen=True)
class Measurement:
    """One (path, N) result.

    seconds: fastest forward + backward wall time of ``calls`` calls; peak_bytes: peak RSS added by the call
    (``memory_method`` says how it was read); full_support_rows: rows whose support is the whole
    vocabulary; max_abs_dlogp / max_abs_dgrad: largest deviation on those rows from the float64
    full-vocabulary logprob / its gradient w.r.t. the hidden state (NaN when there is no row).
    """

    path: str
    tokens: int
    seconds: float
    calls: int
    peak_bytes: int
    memory_method: str
    full_support_rows: int
    max_abs_dlogp: float
    max_abs_dgrad: float


# --------------------------------------------------------------------------- inputs and paths


@dataclass(frozen=True, eq=False)
class _Inputs:
    hidden: torch.Tensor     # float32 [N, H], requires grad
    weight: torch.Tensor     # float32 [V, H], requires grad
    support: torch.Tensor    # int64 [N, 1+K]
    targets: torch.Tensor    # int64 [N]
    fallback: torch.Tensor   # int64 [F] synthetic-EOS slots
    full_rows: torch.Tensor  # int64 rows whose support is the whole vocabulary


def make_inputs(cfg: BenchConfig, n: int) -> _Inputs:
    """Seeded hidden states ``[n, H]``, LM head ``[V, H]`` (logits ~ N(0, 1)) and support rows.

    Row ``i``'s support is its target ``y`` plus ``K - 1`` distinct other ids (random positive
    steps from ``y`` modulo ``V`` whose total stays below ``V``; with ``K == V`` the whole
    vocabulary); the last row of every ``eos_every`` rows is a synthetic-EOS row (candidates -1).
    """
    if n < 1:
        raise BenchError(f"token count must be >= 1, got {n}")
    g = torch.Generator().manual_seed(cfg.seed + n)
    hidden = torch.randn(n, cfg.hidden, generator=g)
    weight = torch.randn(cfg.vocab, cfg.hidden, generator=g).mul_(cfg.hidden ** -0.5)
    y = torch.randint(0, cfg.vocab, (n,), generator=g)
    k = cfg.top_k
    support = torch.empty(n, 1 + k, dtype=torch.long)
    support[:, 0] = y
    support[:, 1] = y
    if k > 1:
        steps = torch.randint(1, cfg.vocab // k + 1, (n, k - 1), generator=g)
        support[:, 2:] = (y[:, None] + steps.cumsum(1)) % cfg.vocab
    fallback = (torch.arange(cfg.eos_every - 1, n, cfg.eos_every) if 0 < cfg.eos_every <= n
                else torch.zeros(0, dtype=torch.long))  # N < eos_every: no complete trajectory
    support[fallback, 1:] = -1
    full_rows = torch.arange(n) if k == cfg.vocab else fallback
    return _Inputs(hidden.requires_grad_(), weight.requires_grad_(), support, y, fallback, full_rows)


def _logprobs(path: str, x: _Inputs, cfg: BenchConfig) -> torch.Tensor:
    if path == "full":
        return full_vocab_logprobs(x.hidden @ x.weight.T, x.targets, cfg.temperature)
    if path == "gather":
        return support_logprobs(x.hidden @ x.weight.T, x.support, cfg.temperature,
                                fallback_rows=x.fallback)
    if path == "fused":
        return fused_support_logprobs(x.hidden, x.weight, x.support, cfg.temperature,
                                      cfg.chunk_size, fallback_rows=x.fallback)
    raise BenchError(f"unknown path {path!r}; expected one of {PATHS}")


def _step(path: str, x: _Inputs, cfg: BenchConfig) -> torch.Tensor:
    """One forward + backward; returns the detached logprobs."""
    x.hidden.grad = None
    x.weight.grad = None
    lp = _logprobs(path, x, cfg)
    lp.sum().backward()
    return lp.detach()


def _reference(x: _Inputs, cfg: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 full-vocabulary logprob and its gradient w.r.t. h on ``x.full_rows``.

    ``d logp_y / d h = (W_y - sum_v p_v W_v) / T`` with ``p = softmax(h W^T / T)``.
    """
    rows = x.full_rows
    w = x.weight.detach().double()
    z = (x.hidden.detach()[rows].double() @ w.T) / cfg.temperature
    logp = torch.log_softmax(z, dim=1)
    y = x.targets[rows]
    grad = (w[y] - logp.exp() @ w) / cfg.temperature
    return logp.gather(1, y[:, None]).squeeze(1), grad


# --------------------------------------------------------------------------- memory


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise BenchError("/proc/self/status has no VmHWM line")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_here(cfg: BenchConfig, path: str, n: int) -> Measurement:
    """Measure one (path, N) in THIS process (see the module docstring; Linux ``/proc`` needed).

    Meant for a fresh process (:func:`run_bench` starts one per configuration); in a process
    that already ran other configurations, freed-but-cached memory can hide part of the peak.

    Raises:
        BenchError: bad sizes / path, or no ``/proc``.
    """
    if path not in PATHS:
        raise BenchError(f"unknown path {path!r}; expected one of {PATHS}")
    if not Path("/proc/self/statm").exists():
        raise BenchError("peak memory is read from Linux /proc; not available here")
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _measure(cfg, path, n)
    finally:
        torch.set_num_threads(before)  # a caller's process keeps its own setting


def _measure(cfg: BenchConfig, path: str, n: int) -> Measurement:
    x = make_inputs(cfg, n)
    m = min(n, 8)  # warm-up on a slice: kernels and thread pools, not the N-sized buffers
    warm = _Inputs(x.hidden.detach()[:m].clone().requires_grad_(), x.weight, x.support[:m],
                   x.targets[:m], x.fallback[x.fallback < m], x.full_rows[:0])
    _step(path, warm, cfg)
    x.weight.grad = None
    del warm
    gc.collect()
    reset = _reset_hwm()
    base = _rss_bytes()
    start = time.perf_counter()
    lp = _step(path, x, cfg)
    times = [time.perf_counter() - start]
    peak = (_hwm_bytes() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
    grad_h = x.hidden.grad
    if x.full_rows.numel():
        ref_lp, ref_grad = _reference(x, cfg)
        dlp = float((lp[x.full_rows].double() - ref_lp).abs().max())
        dgrad = float((grad_h[x.full_rows].double() - ref_grad).abs().max())
    else:
        dlp = dgrad = float("nan")
    while len(times) < cfg.repeats and sum(times) < cfg.repeat_budget_s:
        start = time.perf_counter()
        _step(path, x, cfg)
        times.append(time.perf_counter() - start)
    return Measurement(path, n, min(times), len(times), max(int(peak), 0),
                       "VmHWM-reset" if reset else "ru_maxrss", int(x.full_rows.numel()), dlp, dgrad)


# --------------------------------------------------------------------------- driver


def _child_argv(cfg: BenchConfig, path: str, n: int) -> list[str]:
    return [sys.executable, "-m", "replayrl.tools.bench.logprobs", "--child", path, str(n),
            "--vocab", str(cfg.vocab), "--hidden", str(cfg.hidden), "--top-k", str(cfg.top_k),
            "--temperature", repr(cfg.temperature), "--chunk-size", str(cfg.chunk_size),
            "--eos-every", str(cfg.eos_every), "--seed", str(cfg.seed),
            "--repeats", str(cfg.repeats), "--threads", str(cfg.threads), "--repeat-budget", repr(cfg.repeat_budget_s)]


def _run_child(cfg: BenchConfig, path: str, n: int) -> Measurement:
    proc = subprocess.run(_child_argv(cfg, path, n), capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"{path} N={n} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return Measurement(**json.loads(proc.stdout.strip().splitlines()[-1]))


def run_bench(cfg: BenchConfig, tokens: list[int], *, jobs: int = 1) -> list[Measurement]:
    """Measure every path at every N, one fresh process per (path, N), in (N, path) order.

    ``jobs > 1`` runs that many processes at once: only for smoke runs, since concurrent
    processes share the CPU cores and distort the times.
    """
    if jobs < 1:
        raise BenchError(f"jobs must be >= 1, got {jobs}")
    todo = [(path, n) for n in tokens for path in PATHS]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda pn: _run_child(cfg, *pn), todo))


def _fmt(v: float, spec: str) -> str:
    return "n/a" if v != v else format(v, spec)


def format_table(cfg: BenchConfig, results: list[Measurement]) -> str:
    """Markdown table, one row per (path, N), ratios against ``full`` at the same N."""
    full = {m.tokens: m for m in results if m.path == "full"}
    lines = [
        f"V={cfg.vocab} H={cfg.hidden} top_k={cfg.top_k} T={cfg.temperature} "
        f"chunk={cfg.chunk_size} synthetic EOS every {cfg.eos_every or 'never'} rows, "
        f"{cfg.threads} intra-op thread(s), up to {cfg.repeats} timed calls "
        f"(fewer once {cfg.repeat_budget_s:g} s are spent)",
        "",
        "| path | N | best fwd+bwd s | calls | time / full | peak MiB | peak / full | full-support rows "
        "| max abs dlogp | max abs dgrad_h |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        base = full.get(m.tokens)
        t_ratio = m.seconds / base.seconds if base and base.seconds > 0 else float("nan")
        m_ratio = m.peak_bytes / base.peak_bytes if base and base.peak_bytes > 0 else float("nan")
        lines.append(
            f"| {m.path} | {m.tokens} | {m.seconds:.3f} | {m.calls} | {_fmt(t_ratio, '.3f')} | "
            f"{m.peak_bytes / _MIB:.1f} | {_fmt(m_ratio, '.3f')} | {m.full_support_rows} | "
            f"{_fmt(m.max_abs_dlogp, '.1e')} | {_fmt(m.max_abs_dgrad, '.1e')} |")
    methods = sorted({m.memory_method for m in results})
    lines += [
        "",
        f"peak = VmHWM - VmRSS around one call in a fresh process ({', '.join(methods)}); it "
        f"includes the LM-head gradient, {cfg.vocab * cfg.hidden * 4 / _MIB:.1f} MiB for every path; "
        "[N, V] float32 logits are " + ", ".join(
            f"{n * cfg.vocab * 4 / _MIB:.1f} MiB at N={n}"
            for n in sorted(full) or sorted({m.tokens for m in results})) + ".",
        "dlogp / dgrad_h: max abs deviation from a float64 full-vocabulary reference on the rows "
        "whose support is the whole vocabulary (synthetic-EOS rows, or all rows if top_k == V).",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark flags to ``parser`` (used by ``main`` and by ``replayrl bench logprobs``)."""
    d = BenchConfig()
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096],
                        help="token counts N, one configuration each")
    parser.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size V of the LM head")
    parser.add_argument("--hidden", type=int, default=d.hidden, help="hidden size H")
    parser.add_argument("--top-k", type=int, default=d.top_k,
                        help="support candidates K per row (<= --vocab)")
    parser.add_argument("--temperature", type=float, default=d.temperature,
                        help="sampling temperature the logprobs are taken at (> 0)")
    parser.add_argument("--chunk-size", type=int, default=d.chunk_size,
                        help="rows per chunk of the fused path")
    parser.add_argument("--eos-every", type=int, default=d.eos_every,
                        help="one synthetic-EOS row per this many rows (0 = none)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the random inputs")
    parser.add_argument("--repeats", type=int, default=d.repeats,
                        help="most timed calls per configuration")
    parser.add_argument("--threads", type=int, default=d.threads,
                        help="torch intra-op threads per configuration")
    parser.add_argument("--repeat-budget", type=float, default=d.repeat_budget_s,
                        help="seconds after which a configuration is not timed again")
    parser.add_argument("--jobs", type=int, default=1,
                        help="concurrent configurations (smoke runs only: distorts times)")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "N"), help=argparse.SUPPRESS)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark (or, with the hidden ``--child``, one configuration); return 0."""
    cfg = BenchConfig(vocab=args.vocab, hidden=args.hidden, top_k=args.top_k,
                      temperature=args.temperature, chunk_size=args.chunk_size,
                      eos_every=args.eos_every, seed=args.seed, repeats=args.repeats,
                      threads=args.threads,
                      repeat_budget_s=args.repeat_budget)
    if args.child:
        path, n = args.child
        print(strict_json.dumps(asdict(measure_here(cfg, path, int(n)))))
        return 0
    start, load = time.perf_counter(), os.getloadavg()[0]
    results = run_bench(cfg, args.tokens, jobs=args.jobs)
    print(format_table(cfg, results))
    print(f"bench wall time {time.perf_counter() - start:.1f} s; 1-minute load average "
          f"{load:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m replayrl.tools.bench.logprobs``."""
    parser = bench_parser("logprobs", __doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except BenchError as exc:
        parser.error(str(exc))
        return 2  # unreachable: parser.error exits


if __name__ == "__main__":
    sys.exit(main())
