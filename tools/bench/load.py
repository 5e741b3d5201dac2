"""Benchmark: loading a sharded Hugging Face Qwen3-MoE checkpoint, replayrl's loader against
transformers' ``from_pretrained`` of the same directory (not a test).

The parent process builds a random Qwen3-MoE with transformers (default shape: ~96 M
parameters, 6 layers of 16 experts) and writes it with transformers' ``save_pretrained`` and a
small ``max_shard_size`` into a temporary directory, so both loaders read the very same shards
(from the page cache after the write). Each loader then runs ``--repeats`` times, each time in
a fresh Python process (torch, transformers and replayrl imported before the clock starts):

* ``replayrl``     -- ``replayrl.rollout.model.loader.load_pretrained(dir, float32)``;
* ``transformers`` -- ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`` (baseline).

Reported per loader: the best wall time of the load call, and its peak RSS: ``VmHWM`` after the
load minus ``VmRSS`` before it, with the high-water mark reset first (``/proc/self/clear_refs``,
Linux; otherwise ``ru_maxrss``, an upper bound including the imports), i.e. the physical memory
the load added at its worst moment (memory-mapped shard pages count while mapped). The ratios
are replayrl / transformers (< 1: replayrl is faster / smaller). As a check that both loaded the
same model, each child writes the logits of fixed token ids and the parent prints their largest
difference.

Usage: ``replayrl bench load [--hidden 512] [--layers 6] [--experts 16] [--repeats 3] ...``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from replayrl.tools.bench.usage import at_least, bench_parser

LOADERS = ("replayrl", "transformers")


def model_config(args: argparse.Namespace):
    """The transformers ``Qwen3MoeConfig`` of the benchmarked checkpoint."""
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        moe_intermediate_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=2, head_dim=64,
        num_experts=args.experts, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False)


def write_checkpoint(args: argparse.Namespace, directory: Path) -> int:
    """Write a random checkpoint with transformers; returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(model_config(args))
    model.save_pretrained(directory, max_shard_size=args.shard_size)
    return sum(p.numel() for p in model.parameters())


def _rss_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def child(loader: str, directory: str, logits_out: str) -> dict:
    """Load once in this (fresh) process; returns ``{"seconds", "peak_mib", "peak_kind"}``."""
    import torch
    import transformers

    from replayrl.rollout.model.loader import load_pretrained

    torch.set_num_threads(1)
    ids = torch.arange(32)[None] % 97
    pos = torch.arange(32)[None]
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before, kind = _rss_kib("VmRSS"), "VmHWM - VmRSS before"
    except OSError:
        before, kind = 0, "ru_maxrss"
    start = time.perf_counter()
    if loader == "replayrl":
        model, _ = load_pretrained(directory, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    seconds = time.perf_counter() - start
    peak = _rss_kib("VmHWM") if kind != "ru_maxrss" else None
    if peak is None or before is None:
        peak, before, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, 0, "ru_maxrss"
    with torch.no_grad():
        if loader == "replayrl":
            logits = model(ids, pos).logits
        else:
            logits = model.eval()(input_ids=ids, position_ids=pos).logits
    torch.save(logits, logits_out)
    return {"seconds": seconds, "peak_mib": (peak - before) / 1024, "peak_kind": kind}


def run_child(loader: str, directory: Path, logits_out: Path) -> dict:
    """Run :func:`child` in a fresh interpreter; returns its result."""
    out = subprocess.run([sys.executable, "-m", "replayrl.tools.bench.load", "--child", loader,
                          str(directory), str(logits_out)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{loader} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Best time and largest peak per loader, and the replayrl / transformers ratios."""
    best = {name: {"seconds": min(r["seconds"] for r in runs),
                   "peak_mib": max(r["peak_mib"] for r in runs)} for name, runs in results.items()}
    base, ours = best["transformers"], best["replayrl"]
    best["ratio"] = {"seconds": ours["seconds"] / base["seconds"],
                     "peak_mib": ours["peak_mib"] / base["peak_mib"]}
    return best


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``replayrl bench load``."""
    parser = bench_parser("load", __doc__, details=True)
    parser.add_argument("--hidden", type=at_least(1), default=512, help="hidden size of the random model")
    parser.add_argument("--layers", type=at_least(1), default=6, help="decoder layers of the random model")
    parser.add_argument("--experts", type=at_least(1), default=16, help="experts per MoE layer")
    parser.add_argument("--vocab", type=at_least(1), default=16000, help="vocabulary size")
    parser.add_argument("--shard-size", default="50MB",
                        help="largest shard file (transformers' max_shard_size)")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="fresh processes per loader")
    parser.add_argument("--child", nargs=3, metavar=("LOADER", "DIR", "LOGITS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        from replayrl.transport import strict_json

        print(strict_json.dumps(child(*args.child)))
        return 0
    with tempfile.TemporaryDirectory(prefix="rrl-bench-load-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        n = write_checkpoint(args, ckpt)
        shards = sorted(ckpt.glob("*.safetensors"))
        size = sum(p.stat().st_size for p in shards) / 2 ** 20
        print(f"Qwen3-MoE checkpoint written by transformers: {n / 1e6:.1f} M parameters, fp32, "
              f"{len(shards)} shards, {size:.0f} MiB; {args.repeats} fresh process(es) per "
              f"loader, 1 torch thread", flush=True)
        results: dict[str, list[dict]] = {name: [] for name in LOADERS}
        for _ in range(args.repeats):
            for name in LOADERS:  # interleaved, so a load spike hits both
                results[name].append(run_child(name, ckpt, Path(tmp) / f"{name}.pt"))
        import torch

        diff = (torch.load(Path(tmp) / "replayrl.pt", weights_only=True)
                - torch.load(Path(tmp) / "transformers.pt", weights_only=True)).abs().max().item()
    best = summarize(results)
    print(f"| loader | load s (best) | peak RSS added MiB ({results['replayrl'][0]['peak_kind']}) |")
    print("|---|---|---|")
    for name in LOADERS:
        print(f"| {name} | {best[name]['seconds']:.2f} | {best[name]['peak_mib']:.0f} |")
    print(f"| ratio replayrl / transformers | {best['ratio']['seconds']:.2f}x | "
          f"{best['ratio']['peak_mib']:.2f}x |")
    print(f"max |logits difference| between the two loaded models: {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
