"""Test helper (run as a script, one process per torchrun rank): build a tiny megatron-core
GPTModel (dense + MoE layers) on CPU, run forward, backward and one optimizer step, with
megatron_cpu_compat items switched off as named in ``--skip``. Prints ``PROBE OK`` at the end.

Usage: python tests/megatron_probe.py [--skip ITEM,...] [--tp N] [--ep N] [--cp N]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip", default="")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    args = parser.parse_args()

    import torch

    from replayrl.rollout.model.config import default_config
    from replayrl.trainer.backends import megatron_cpu_compat as compat
    from replayrl.trainer.backends.megatron_model import MegatronParallel, build_gpt_model, init_parallel

    compat.enable(skip=[s for s in args.skip.split(",") if s])
    parallel = MegatronParallel(tp=args.tp, ep=args.ep, cp=args.cp)
    init_parallel(parallel, seed=1)
    cfg = dataclasses.replace(default_config(16), index_topk=0, hidden_size=32, head_dim=8,
                              intermediate_size=32, moe_intermediate_size=16, num_experts=4)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    with compat.cpu_device_scope():
        model, tcfg, _ = build_gpt_model(cfg, parallel)
        dist_opt = ps.get_data_parallel_world_size() > 1
        ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(
            use_distributed_optimizer=dist_opt), model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0,
                                                     use_distributed_optimizer=dist_opt), [ddp])
        s = 8 // args.cp  # each CP rank forwards its 2 of 2 x cp chunks of the 8 positions
        tokens = torch.randint(0, 16, (2, s), generator=torch.Generator().manual_seed(0))
        logits = ddp(tokens, torch.arange(s).expand(2, s), attention_mask=None)
        logits.float().pow(2).mean().backward()
        finalize_model_grads([ddp])
        ok, norm, _ = opt.step()
    assert ok and norm > 0, (ok, norm)
    print("PROBE OK")


if __name__ == "__main__":
    main()
