"""Benchmark: LoRA weight pushes and optimizer memory, with and without LoRA (not a test).

Prints two markdown tables (docs/benchmarks.md#lora is their output):

* per model (the embedded default policy, and a ~100M-parameter Qwen3-MoE built from a config,
  nothing downloaded): parameters, bytes of one weight push without LoRA (every weight, fp32)
  and with ``--lora-rank`` adapters on the default targets (the factors only, fp32:
  ``replayrl.trainer.lora.peft_adapter.adapter_arrays``), and AdamW's state (two fp32 moments per trained
  scalar) without and with LoRA. The embedded model's state is measured from an optimizer after
  one step; the 100M model's is counted (8 bytes per trained scalar: the same rule).
* on the embedded model, how the engine applies a LoRA push, medians of ``--repeats``: merged
  (``replayrl.rollout.model.adapters.AdapterMerge``: once per push, the forward unchanged)
  against as adapters (every forward through peft's LoRA layers plus the expert
  parametrization, as the trainer computes it), for a forward of ``--rows`` x ``--tokens``.

Usage: ``python -m replayrl.tools.bench.lora [--rank 8] [--repeats 5] [--rows 64] [--tokens 32]``
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from replayrl.rollout.model.adapters import AdapterMerge
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.tools.bench.usage import at_least, bench_parser

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def moe_100m_config() -> ModelConfig:
    """A ~102M-parameter Qwen3-MoE: 8 MoE layers of 20 experts (top-4), hidden 512, vocabulary
    32000, untied LM head."""
    return ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                       moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, num_experts=20, num_experts_per_tok=4,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(),
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048)


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


def _row(name: str, params: int, adapters: int, full_push: int, lora_push: int,
         opt_full: int, opt_lora: int, measured: bool) -> str:
    how = "measured" if measured else "counted"
    return (f"| {name} | {params / 1e6:.2f}M | {adapters / 1e6:.3f}M | {_mib(full_push)} | "
            f"{_mib(lora_push)} ({full_push / lora_push:.0f}x less) | {_mib(opt_full)} | "
            f"{_mib(opt_lora)} ({how}) |")


def _embedded(rank: int, directory: Path):
    """(table row, LoRA backend) of the embedded default policy."""
    from replayrl.tools.run.from_flags import build_config
    from replayrl.tools.run.launcher import write_initial_checkpoint
    from replayrl.trainer.backends.torch_backend import TorchBackend
    from replayrl.trainer.config import TrainerConfig

    checkpoint = write_initial_checkpoint(build_config({}), directory / "model")
    sizes = {}
    for r in (0, rank):
        backend = TorchBackend(str(checkpoint), TrainerConfig(lora_rank=r), [])
        for p in backend.params:  # one step with zero gradients fills AdamW's state
            p.grad = torch.zeros_like(p)
        backend.optimizer.step()
        state = sum(t.numel() * t.element_size() for s in backend.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        push = sum(t.numel() * t.element_size() for t in backend.push_tensors(full=not r).values())
        sizes[r] = (backend, push, state, sum(p.numel() for p in backend.params))
    full, lora_ = sizes[0], sizes[rank]
    row = _row("embedded default", full[0].parameter_count(), lora_[3], full[1], lora_[1],
               full[2], lora_[2], True)
    return row, lora_[0]


def _moe_100m(rank: int) -> str:
    from replayrl.trainer.lora import peft_adapter as lora

    model = Qwen3MoeForCausalLM.empty(moe_100m_config(), torch.float32)
    params = sum(p.numel() for p in model.parameters())
    lora.add_adapters(model, rank, 16.0, TARGETS, seed=0)
    adapters = sum(p.numel() for p in lora.adapter_parameters(model))
    lora_push = sum(a.nbytes for a in lora.adapter_arrays(model).values())
    return _row("Qwen3-MoE ~100M (config)", params, adapters, 4 * params, lora_push,
                8 * params, 8 * adapters, False)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _apply_modes(backend, rows: int, tokens: int, repeats: int) -> list[str]:
    """Merged vs as-adapters rows on the embedded model (fp32)."""
    from replayrl.trainer.lora import peft_adapter as lora

    model = backend.model
    cfg = backend.model_config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.01)
    plain = Qwen3MoeForCausalLM.empty(cfg, torch.float32).eval()
    plain.load_state_dict(lora.base_state(model))
    factors = lora.adapter_arrays(model)
    merge = AdapterMerge()
    merge_ms = _median_ms(lambda: merge.apply(plain, factors), repeats)
    ids = torch.randint(3, cfg.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(tokens).expand(rows, tokens)
    model.eval()

    def adapted():
        with lora.experts_adapted(model):
            model(ids, pos)

    with torch.no_grad():
        merged_ms = _median_ms(lambda: plain(ids, pos), repeats)
        adapter_ms = _median_ms(adapted, repeats)
    return [f"| merged into the kept base (this engine) | {merge_ms:.2f} ms once per push | "
            f"{merged_ms:.2f} ms |",
            f"| as adapters at every forward | 0 | {adapter_ms:.2f} ms "
            f"(+{adapter_ms - merged_ms:.2f} ms per forward) |"]


def main(argv: list[str] | None = None) -> None:
    """Print the tables (module docstring)."""
    parser = bench_parser("lora", __doc__)
    parser.add_argument("--rank", type=at_least(1), default=8, help="LoRA rank (replayrl train's --lora-rank)")
    parser.add_argument("--repeats", type=at_least(1), default=5,
                        help="timings of each way to apply a push; the median is shown")
    parser.add_argument("--rows", type=at_least(1), default=64, help="rows of the timed forward")
    parser.add_argument("--tokens", type=at_least(1), default=32, help="tokens per row of the timed forward")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"LoRA rank {args.rank}, alpha 16, targets {','.join(TARGETS)} (every expert included), fp32")
    print()
    print("| model | parameters | adapter parameters | push without LoRA | push with LoRA | "
          "AdamW state without LoRA | AdamW state with LoRA |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        row, backend = _embedded(args.rank, Path(tmp))
        print(row)
        print(_moe_100m(args.rank))
        print()
        print(f"Applying a push on the engine, embedded model, forward of {args.rows} x {args.tokens} "
              f"tokens, 1 thread, medians of {args.repeats}:")
        print()
        print("| engine applies LoRA | cost per push | forward |")
        print("|---|---|---|")
        for line in _apply_modes(backend, args.rows, args.tokens, args.repeats):
            print(line)


if __name__ == "__main__":
    main()
