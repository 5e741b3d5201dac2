"""Benchmark: bytes per token of the stored traces against int32 and the information bound, and
the time to decode them (not a test; docs/benchmarks.md "Trace storage").

For contexts of 4k, 32k and 128k tokens of two model shapes (:data:`SHAPES`, ``--shape``): a
GLM-5-sized model (transformers' ``GlmMoeDsaConfig`` defaults: 78 layers, every one indexed
with ``index_topk`` 2048 over the keys; 75 MoE layers of 256 experts, top-8) and a
DeepSeek-V4-sized one (``DeepseekV4Config`` defaults: 20 compressed sparse attention layers whose
indexer keeps ``index_topk`` 512 of the compressed entries, one per 4 keys; 40 top-k MoE layers of
256 experts, top-6; its 3 hash-routed layers and its heavily compressed layers store no trace) it
prints, per token of a trajectory of that length (mean over its positions):

* int32 as the column form carried it before (indexer rows ``[78, 2048]`` plus routing ``[75,
  8]``; ``[20, 512]`` plus ``[40, 6]``) and miles' host buffer for indexer traces
  (``index_topk`` int32 per indexed layer);
* ours (``replayrl.rollout.traces.trace_storage``: indexer rows as sets of the keys, or of the
  compressed entries, their query sees; experts as uint8), and the ratio int32 / ours, measured in
  the same run;
* the information bound: ``log2 C(n, k)`` bits per indexer row (a query at position ``p`` sees
  ``n = p + 1`` keys, or ``n = (p + 1) // 4`` compressed entries, and picks ``k = min(index_topk,
  n)`` of them) summed over the layers, plus ``log2(256! / (256 - top_k)!)`` bits per routing row
  (the experts in their order, which is carried), and ours / bound;
* the CPU time to decode them (one thread, numpy) in microseconds per token, and below the
  table the indexer rows' time with the torch decoder (``replayrl.trainer.replay.trace_decode``) on
  the CPU, one thread (it is meant for a GPU, where it has not been run here);
* below the table, the CPU time per token of widening the decoded indexer rows (int32) into
  the trainer batch's int64 as ``replayrl.trainer.batching.batch`` collates them (a fill of the padded
  block, then a converting copy), one thread: work after the decode (the embedded model itself
  accepts int32 key slots and widens them on its device);
* with ``--decode-threads N`` (N > 1), the indexer rows' decode (``decode_sets(threads=N)``)
  timed by the wall clock on N threads and on one, calls alternating, best of ``--repeats``
  each: three more columns, the N-thread time per token, its speedup over one thread, and the
  CPU time of the N threads together (the work the split adds shows there; the wall clock on
  a machine shared with other jobs shows the cores they left), MEASURED on this machine (run
  with ``--priority`` on a shared one);
* decoding's share of a trainer step, which is an ESTIMATE, not a measurement: ``6 x
  active parameters`` FLOPs per trained token (forward and backward; attention and the
  indexer's own FLOPs left out, which only lengthen the step, so the share is an upper bound
  at the assumed rate) over an assumed sustained rate per GPU (``--active-params``, default
  the shape's: 40.8 B for GLM-5, 13.3 B for DeepSeek-V4, transformers' default config counted on
  the meta device, top-k of 256 routed experts a token, the input embedding (a lookup) left
  out; ``--sustained-tflops``,
  default 400 TFLOP/s bf16, about 40 % of an H100/H200's dense peak), against the decode time
  per token of one rank spread over ``--decode-cores`` of that rank's CPU cores (default 8:
  chunks of a column decode independently; one thread's time over the cores, i.e. perfect
  scaling ASSUMED, which ``--decode-threads`` measures up to the machine's cores) and
  ``--pipeline-stages`` (default 1: a rank decodes every layer's traces of its tokens; a
  stage only its own layers'). With
  ``--trainer-us-per-token`` (a trainer's measured step time per token of that context; one
  ``--shape`` only, as for ``--active-params``) the share of that measured step is printed as well.

A last row takes the embedded default model (4 layers: 3 MoE of 8 experts top-2, 2 indexed with
``index_topk`` 8) with a default step's batch (128 trajectories of 7 prompt + 2 response
tokens, about the built-in task's) and puts the decoding of that step's traces against the
embedded model's measured step time (``--step-seconds``, default 0.0491 s: docs/benchmarks.md "Step time").

Indexer choices are synthetic, drawn per (position, layer): the ``--sinks`` first keys
(attention sinks), the ``--window`` most recent keys, and the rest of the ``k`` uniformly at
random among the other keys, listed in a random order (the engine lists them by score); for
compressed entries the same with ``--sinks`` and ``--window`` divided by the entry's 4 keys;
expert ids uniform over the 256 experts, distinct per row. Rows are sampled at ``--positions``
stratified positions of the context (and ``--layers`` layers each); per-token figures scale
the sample's mean per row to all layers.

Usage: ``replayrl bench traces [--quick] [--priority] [--decode-threads N] [--shape glm5 deepseek_v4]``
(``python -m replayrl.tools.bench.traces``)
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from replayrl.rollout.traces import trace_table
from replayrl.rollout.traces.trace_storage import decode_column, encode_column
from replayrl.tools.bench.usage import at_least, bench_parser
from replayrl.transport.trace_codec import decode_sets, encode_sets, encoded_nbytes


@dataclass(frozen=True)
class Shape:
    """The traces of one model shape.

    Attributes:
        label: the name printed in the table.
        indexed_layers: layers storing an indexer row per token; index_topk: its width.
        rate: keys per indexed entry (1: the indexer picks keys; 4: compressed entries, entry
            ``w`` covering keys ``[4w, 4w + 4)``, so a query at ``p`` sees ``(p + 1) // 4``).
        moe_layers: layers storing a routing row per token, of ``top_k`` of ``experts``.
        active_params: parameters a token passes through (the step ESTIMATE's default).
    """

    label: str
    indexed_layers: int
    index_topk: int
    rate: int
    moe_layers: int
    experts: int
    top_k: int
    active_params: float


GLM5 = Shape("GLM-5", 78, 2048, 1, 75, 256, 8, 40.8e9)
"""transformers 5.24 ``GlmMoeDsaConfig()`` defaults (num_hidden_layers 78, indexer_types all
"full", first_k_dense_replace 3, n_routed_experts 256, num_experts_per_tok 8, index_topk 2048).
Active parameters: built on the meta device it holds 743.9 B, 724.8 B of them in routed experts
of which a token uses 8 of 256; that gives 41.8 B, less the 0.95 B input embedding (a lookup,
no matmul)."""

DEEPSEEK_V4 = Shape("DeepSeek-V4", 20, 512, 4, 40, 256, 6, 13.3e9)
"""transformers 5.25 ``DeepseekV4Config()`` defaults: 43 layers, 20 of layer type
"compressed_sparse_attention" (compress rate 4, index_topk 512), the other 23 heavily compressed
(rate 128, no indexer); mlp_layer_types 40 "moe" (n_routed_experts 256, num_experts_per_tok 6)
and 3 "hash_moe" (routed by a hash of the token id: no trace). Active parameters: built on the
meta device it holds 284.3 B, 277.0 B of them in routed experts of which a token uses 6 of 256;
that gives 13.8 B, less the 0.53 B input embedding."""

SHAPES = {"glm5": GLM5, "deepseek_v4": DEEPSEEK_V4}
"""The shapes ``--shape`` names."""

CONTEXTS = (4096, 32768, 131072)


def estimated_step_us_per_token(active_params: float, sustained_tflops: float) -> float:
    """An ESTIMATE of a trainer's step time per trained token per GPU, microseconds: ``6 *
    active_params`` FLOPs (forward 2, backward 4 per parameter) over ``sustained_tflops``
    (TFLOP/s one GPU sustains). Not a measurement."""
    return 6.0 * active_params / (sustained_tflops * 1e12) * 1e6


def draw_indexer_rows(positions: np.ndarray, layers: int, k: int, window: int, sinks: int,
                      rng: np.random.Generator, rate: int = 1) -> np.ndarray:
    """int32 ``[len(positions), layers, k]``: per (position p, layer) the ``n = (p + 1) // rate``
    keys (``rate`` 1) or compressed entries a causal query at ``p`` sees, of which it selects all
    when ``n <= k``, else ``sinks`` first + ``window`` last + random others, in random slot
    order, ``-1`` after them."""
    out = np.full((len(positions), layers, k), -1, np.int32)
    for i, p in enumerate(positions.tolist()):
        n = (p + 1) // rate
        for layer in range(layers):
            if n <= k:
                chosen = np.arange(n)
            else:
                s, w = min(sinks, k), min(window, k - min(sinks, k))
                middle = rng.choice(n - s - w, size=k - s - w, replace=False) + s
                chosen = np.concatenate([np.arange(s), middle, np.arange(n - w, n)])
            out[i, layer, :len(chosen)] = rng.permutation(chosen)
    return out


def bound_bits_per_token(context: int, k: int, layers: int, rate: int = 1) -> float:
    """Mean over positions ``0..context-1`` of ``log2 C(n, min(k, n))``, ``n = (p + 1) // rate``
    the keys (``rate`` 1) or compressed entries the query at ``p`` sees, times ``layers``: the
    information in one token's indexer rows."""
    n = (np.arange(1, context + 1) // rate).astype(np.float64)
    kk = np.minimum(k, n)
    lg = np.vectorize(math.lgamma)
    bits = (lg(n + 1) - lg(kk + 1) - lg(n - kk + 1)) / math.log(2)
    return float(bits.mean()) * layers


def routing_bound_bits(experts: int, top_k: int) -> float:
    """``log2(experts! / (experts - top_k)!)``: top_k distinct experts in order."""
    return (math.lgamma(experts + 1) - math.lgamma(experts - top_k + 1)) / math.log(2)


def _timed_wall(fns: list, repeats: int) -> tuple[list[float], list[float]]:
    """Best wall-clock seconds (``time.perf_counter``: what threads working for the caller take)
    and best CPU seconds of the whole process (``time.process_time``: every thread's) of each of
    ``fns`` over ``repeats`` rounds, the calls alternating within a round so that a change in
    the machine's load touches every one alike."""
    wall, cpu = [math.inf] * len(fns), [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[i] = min(wall[i], time.perf_counter() - start)
            cpu[i] = min(cpu[i], time.process_time() - start_cpu)
    return wall, cpu


def _timed(fn, repeats: int) -> float:
    """Best CPU seconds of this thread (``time.thread_time``: other jobs on a shared machine do
    not count) over ``repeats`` calls of ``fn``."""
    best = math.inf
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def measure_context(context: int, *, positions: int, layers: int, window: int, sinks: int,
                    repeats: int, rng: np.random.Generator, decode_threads: int = 1,
                    shape: Shape = GLM5) -> dict[str, Any]:
    """Per-token figures of one context length of ``shape`` (see the module docstring); with
    ``decode_threads > 1`` also ``threads_us_per_token`` (wall clock, that many threads),
    ``threads_cpu_us_per_token`` (the CPU time of all of them) and
    ``one_thread_wall_us_per_token`` (wall clock, one thread, timed alternately). ``window``
    and ``sinks`` are keys: divided by ``shape.rate`` for compressed entries."""
    g = shape
    pos = np.unique(((np.arange(positions) + rng.random(positions)) * context / positions)
                    .astype(np.int64).clip(0, context - 1))
    idx_spec, route_spec = trace_table.spec("indexer_topk"), trace_table.spec("routed_experts")
    rows = draw_indexer_rows(pos, layers, g.index_topk, window // g.rate, sinks // g.rate, rng, g.rate)
    # the sampled rows sit at positions ``pos``, not 0..: the set codec takes their universes
    # ((p + 1) // rate keys or entries) directly; encode_column / decode_column give it the
    # same for a trajectory (its stride: the rate, found from the rows)
    universe = (pos + 1) // g.rate
    enc = encode_sets(rows, universe)
    ours_idx = encoded_nbytes(enc) / (len(pos) * layers) * g.indexed_layers
    decode_s = _timed(lambda: decode_sets(enc, universe, idx_spec.dtype), repeats)
    back = decode_sets(enc, universe, idx_spec.dtype)
    assert np.array_equal(np.sort(np.where(back < 0, 1 << 30, back), -1),
                          np.sort(np.where(rows < 0, 1 << 30, rows), -1)), "round trip"
    experts = np.argsort(rng.random((len(pos), g.moe_layers, g.experts)), axis=-1)[..., :g.top_k]
    experts = experts.astype(np.int32)
    counts = np.ones(len(pos), np.int64)
    enc_r = encode_column(route_spec, experts, counts)
    ours_route = encoded_nbytes(enc_r) / len(pos)
    route_s = _timed(lambda: decode_column(route_spec, enc_r, counts), repeats)  # all MoE layers
    torch_s = _timed_torch(enc, universe, back, repeats)
    per_row = g.indexed_layers / (len(pos) * layers) * 1e6  # seconds of the sample -> us/token
    wide = np.empty(back.shape, np.int64)
    widen_s = _timed(lambda: (wide.fill(-1), np.copyto(wide, back)), repeats)  # as trainer.batch collates
    threaded = {}
    if decode_threads > 1:
        out = np.empty_like(back)
        assert np.array_equal(decode_sets(enc, universe, out=out, threads=decode_threads), back), "threads"
        (one, many), (_, many_cpu) = _timed_wall(
            [lambda: decode_sets(enc, universe, out=out),
             lambda: decode_sets(enc, universe, out=out, threads=decode_threads)], repeats)
        threaded = {"one_thread_wall_us_per_token": one * per_row, "threads_us_per_token": many * per_row,
                    "threads_cpu_us_per_token": many_cpu * per_row}
    int32_idx = g.indexed_layers * g.index_topk * 4
    int32_route = g.moe_layers * g.top_k * 4
    bound = (bound_bits_per_token(context, g.index_topk, g.indexed_layers, g.rate)
             + g.moe_layers * routing_bound_bits(g.experts, g.top_k)) / 8
    ours = ours_idx + ours_route
    per_token_s = decode_s / (len(pos) * layers) * g.indexed_layers + route_s / len(pos)
    return {"context": context, "int32": int32_idx + int32_route, "miles": int32_idx,
            "ours": ours, "ours_indexer": ours_idx, "ours_routing": ours_route, "bound": bound,
            "decode_us_per_token": per_token_s * 1e6, "rows": len(pos) * layers,
            "torch_us_per_token": torch_s * per_row, "widen_us_per_token": widen_s * per_row, **threaded}


def _timed_torch(enc: dict, universe: np.ndarray, want: np.ndarray, repeats: int) -> float:
    """Best CPU seconds of ``replayrl.trainer.replay.trace_decode.decode_sets_torch`` decoding ``enc``
    on the CPU with one torch thread (the calling thread: what ``time.thread_time`` counts),
    after checking it gives ``want`` (the numpy decoder's result)."""
    import torch

    from replayrl.trainer.replay.trace_decode import decode_sets_torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert np.array_equal(decode_sets_torch(enc, universe).numpy(), want), "torch decoder"
        return _timed(lambda: decode_sets_torch(enc, universe), repeats)
    finally:
        torch.set_num_threads(threads)


def measure_embedded(step_seconds: float, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    """Decode time of one default step's traces (128 trajectories, 7 + 2 tokens: 8 trace rows
    each; 3 MoE layers of 8 experts top-2; 2 indexed layers, index_topk 8) against the
    embedded model's measured step."""
    n, rows_each, k = 128, 8, 8
    counts = np.full(n, rows_each, np.int64)
    idx_spec, route_spec = trace_table.spec("indexer_topk"), trace_table.spec("routed_experts")
    keys = np.concatenate([draw_indexer_rows(np.arange(rows_each), 2, k, 2, 1, rng)
                           for _ in range(n)])
    experts = np.argsort(rng.random((n * rows_each, 3, 8)), axis=-1)[..., :2].astype(np.int32)
    enc_i, enc_r = encode_column(idx_spec, keys, counts), encode_column(route_spec, experts, counts)
    decode_s = _timed(lambda: (decode_column(idx_spec, enc_i, counts),
                               decode_column(route_spec, enc_r, counts)), repeats)
    tokens = n * rows_each
    return {"int32": (keys.nbytes + experts.nbytes) / tokens,
            "ours": (encoded_nbytes(enc_i) + encoded_nbytes(enc_r)) / tokens,
            "decode_ms": decode_s * 1e3, "step_ms": step_seconds * 1e3}


def main(argv: list[str] | None = None) -> None:
    """Print the table (markdown) of the module docstring.

    Raises:
        SystemExit: bad flags (argparse).
        replayrl.tools.errors.PriorityError: ``--priority`` where the autogroup cannot be set.
    """
    parser = bench_parser("traces", __doc__)
    parser.add_argument("--quick", action="store_true",
                        help="few sampled rows and one repeat (for tests; noisier figures)")
    parser.add_argument("--positions", type=at_least(1), default=96, help="sampled positions per context")
    parser.add_argument("--layers", type=at_least(1), default=2, help="sampled layers per position")
    parser.add_argument("--window", type=at_least(0), default=512, help="most recent keys every query selects")
    parser.add_argument("--sinks", type=at_least(0), default=16, help="first keys every query selects")
    parser.add_argument("--repeats", type=at_least(1), default=5,
                        help="timings of each decode; the best is kept")
    parser.add_argument("--step-seconds", type=float, default=0.0491,
                        help="the embedded model's measured step (docs/benchmarks.md 'Step time')")
    parser.add_argument("--trainer-us-per-token", type=float, nargs=3, default=None,
                        metavar=("US_4K", "US_32K", "US_128K"),
                        help="the one --shape's trainer's measured step microseconds per token at "
                             "each context: prints decoding's share of it (default: none, no such "
                             "trainer is measured here)")
    parser.add_argument("--shape", nargs="+", choices=tuple(SHAPES), default=list(SHAPES),
                        help="model shapes whose traces are measured (default: all: GLM-5's "
                             "keys, DeepSeek-V4's compressed entries)")
    parser.add_argument("--active-params", type=float, default=None,
                        help="the one --shape's active parameters per token for the step ESTIMATE "
                             f"(default: the shape's own, GLM-5 {GLM5.active_params:.3g}, "
                             f"DeepSeek-V4 {DEEPSEEK_V4.active_params:.3g})")
    parser.add_argument("--sustained-tflops", type=float, default=400.0,
                        help="TFLOP/s one GPU sustains, for the step ESTIMATE (~40 %% of an "
                             "H100/H200's bf16 dense peak)")
    parser.add_argument("--decode-cores", type=at_least(1), default=8,
                        help="CPU cores of a trainer rank that decode its traces (chunks in parallel)")
    parser.add_argument("--decode-threads", type=at_least(1), default=1,
                        help="also time the indexer rows' decode on this many threads (wall clock, "
                             "measured here) against one")
    parser.add_argument("--pipeline-stages", type=at_least(1), default=1,
                        help="pipeline stages: a rank decodes only its stage's layers")
    parser.add_argument("--priority", action="store_true",
                        help="on a machine shared with other users' jobs, run first "
                             "(Linux autogroup nice -20; needs root)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled traces")
    args = parser.parse_args(argv)
    if (args.sustained_tflops <= 0 or (args.active_params is not None and args.active_params <= 0)
            or args.decode_cores < 1 or args.pipeline_stages < 1 or args.decode_threads < 1):
        parser.error("--active-params, --sustained-tflops, --decode-cores, --decode-threads and "
                     "--pipeline-stages must be positive")
    args.shape = list(dict.fromkeys(args.shape))
    if len(args.shape) > 1 and (args.active_params is not None or args.trainer_us_per_token):
        parser.error("--active-params and --trainer-us-per-token describe one model: give one --shape")
    from replayrl.tools.bench.priority import autogroup_priority

    with autogroup_priority(args.priority):
        _report(args)


def _report(args: argparse.Namespace) -> None:
    """Print the table (markdown) of the module docstring for parsed ``args``."""
    if args.quick:
        args.positions, args.layers, args.repeats = 8, 1, 1
    rng = np.random.default_rng(args.seed)
    shapes = [SHAPES[name] for name in args.shape]
    step = args.trainer_us_per_token
    per_rank = args.decode_cores * args.pipeline_stages
    estimates = {}
    for g in shapes:
        what = "keys" if g.rate == 1 else f"compressed entries of {g.rate} keys"
        print(f"{g.label} shape: {g.indexed_layers} indexed layers, index_topk {g.index_topk} of the "
              f"{what}, {g.moe_layers} MoE layers of {g.experts} experts top-{g.top_k}; indexer rows: "
              f"{args.sinks // g.rate} sinks + {args.window // g.rate} most recent + random; "
              f"{args.positions} positions x {args.layers} layers sampled per context")
        active = args.active_params if args.active_params is not None else g.active_params
        estimates[g.label] = estimated_step_us_per_token(active, args.sustained_tflops)
        print(f"{g.label} trainer step, an ESTIMATE, not a measurement: 6 x {active / 1e9:.1f} B "
              f"active params = {6 * active:.3g} FLOPs per token / {args.sustained_tflops:g} "
              f"TFLOP/s sustained per GPU = {estimates[g.label]:,.0f} us per token per GPU; decoding on "
              f"{args.decode_cores} CPU core(s) of the rank, {args.pipeline_stages} pipeline stage(s)")
    threads = args.decode_threads
    print("| model | context | int32 today (indexer + routing), B/token | miles' int32 indexer buffer, "
          "B/token | ours, B/token | int32 / ours | bound, B/token | ours / bound | "
          f"decode, CPU us/token | decode per rank ({args.decode_cores} cores, perfect scaling assumed), "
          "us/token | share of the estimated step | cores for 5 % |"
          + (f" indexer decode on {threads} threads, wall us/token (measured) | speedup over 1 thread "
             f"(wall, measured) | CPU us/token of the {threads} threads together (measured) |"
             if threads > 1 else "")
          + (" decode / measured step |" if step else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if threads > 1 else "")
          + ("---|" if step else ""))
    torch_us, widen_us = {g.label: [] for g in shapes}, {g.label: [] for g in shapes}
    for g in shapes:
        estimate = estimates[g.label]
        for i, context in enumerate(CONTEXTS):
            r = measure_context(context, positions=args.positions, layers=args.layers,
                                window=args.window, sinks=args.sinks, repeats=args.repeats, rng=rng,
                                decode_threads=threads, shape=g)
            rank_us = r["decode_us_per_token"] / per_rank
            share = f" {100 * r['decode_us_per_token'] / step[i]:.1f} % |" if step else ""
            if threads > 1:
                share = (f" {r['threads_us_per_token']:,.0f} | "
                         f"{r['one_thread_wall_us_per_token'] / r['threads_us_per_token']:.2f}x | "
                         f"{r['threads_cpu_us_per_token']:,.0f} |") + share
            need = r["decode_us_per_token"] / args.pipeline_stages / (0.05 * estimate)
            print(f"| {g.label} | {context // 1024}k | {r['int32']:,.0f} | {r['miles']:,.0f} | {r['ours']:,.0f} "
                  f"| {r['int32'] / r['ours']:.1f}x | {r['bound']:,.0f} | {r['ours'] / r['bound']:.2f}x "
                  f"| {r['decode_us_per_token']:,.0f} | {rank_us:,.1f} | {100 * rank_us / estimate:.1f} % "
                  f"| {math.ceil(need)} |" + share)
            torch_us[g.label].append(r["torch_us_per_token"])
            widen_us[g.label].append(r["widen_us_per_token"])
    at = " / ".join(f"{c // 1024}k" for c in CONTEXTS)

    def per_shape(values: dict[str, list[float]]) -> str:
        return "; ".join(f"{label} " + " / ".join(f"{t:,.0f}" for t in ts) for label, ts in values.items())

    print("\nthe torch decoder (replayrl.trainer.replay.trace_decode, written for the trainer's GPU; not run on "
          f"a GPU here) on this CPU, one thread: {per_shape(torch_us)} us per token at {at} indexer rows")
    print("widening the decoded indexer rows to the trainer batch's int64 (replayrl.trainer.batching.batch's "
          f"collation: fill, then a converting copy), one thread: {per_shape(widen_us)} CPU us per token "
          f"at {at}, after the decode")
    e = measure_embedded(args.step_seconds, args.repeats, rng)
    print(f"\nembedded default step (128 x (7 + 2) tokens): int32 {e['int32']:.0f} B/token, ours "
          f"{e['ours']:.1f} B/token; decoding the step's traces {e['decode_ms']:.2f} ms of a "
          f"{e['step_ms']:.1f} ms step ({100 * e['decode_ms'] / e['step_ms']:.1f} %; step: "
          f"docs/benchmarks.md, measured)")


if __name__ == "__main__":
    main()
