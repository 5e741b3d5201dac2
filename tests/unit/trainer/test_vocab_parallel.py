"""Vocabulary-parallel support logprobs: 2 gloo processes against the single-process path."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from replayrl.trainer.errors import LogprobError
from replayrl.trainer.loss.logprobs import support_logprobs
from replayrl.trainer.parallel.vocab_parallel import vocab_parallel_support_logprobs
from tests.ports import port_block

WORLD, N, V, K, T = 2, 9, 16, 4, 0.8


def batch():
    """Logits, support (candidates on both shards, fallback and padding rows), upstream grad."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64)
    rows = []
    for i in range(N):
        cands = torch.randperm(V, generator=g)[: 1 + i % K].tolist()
        rows.append([cands[-1]] + cands + [-1] * (K - len(cands)))
    rows[0] = [3, 3, 12, -1, -1]  # one candidate per shard
    rows[1] = [9, 9, 10, 11, -1]  # all on shard 1
    rows[4] = [13] + [-1] * K  # synthetic-EOS fallback, y on shard 1
    rows[6] = [-1] * (K + 1)  # padding
    rows[8] = [2] + [-1] * K  # fallback, y on shard 0
    upstream = torch.linspace(-1.0, 1.5, N, dtype=torch.float64)
    return logits, torch.tensor(rows, dtype=torch.int32), upstream


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        real = dist.all_reduce
        for use_slots in (False, True):
            calls = []

            def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
                calls.append(str(op))
                return real(tensor, op=op, group=group, async_op=async_op)

            dist.all_reduce = counting_all_reduce  # this child process only
            logits, support, upstream = batch()
            shard = logits[:, rank * V // WORLD : (rank + 1) * V // WORLD].float().requires_grad_(True)
            slots = torch.tensor([4, 5, 8]) if use_slots else None
            out = vocab_parallel_support_logprobs(shard, support, T, fallback_rows=slots)
            (out * upstream.float()).sum().backward()
            torch.save({"out": out.detach(), "grad": shard.grad, "calls": calls},
                       Path(out_dir) / f"slots{int(use_slots)}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()



@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """Run both variants in one spawn: starting processes dominates the cost."""
    out_dir = tmp_path_factory.mktemp("vocab_parallel")
    mp.spawn(_worker, args=(port_block(), str(out_dir)), nprocs=WORLD, join=True)
    return out_dir


@pytest.mark.parametrize("use_slots", [False, True])
def test_two_rank_vocab_parallel_matches_single_process(two_rank_results, use_slots):
    logits, support, upstream = batch()
    full = logits.float().requires_grad_(True)
    ref = support_logprobs(full, support, T)
    (ref * upstream.float()).sum().backward()
    results = [torch.load(two_rank_results / f"slots{int(use_slots)}_rank{r}.pt") for r in range(WORLD)]
    for res in results:
        torch.testing.assert_close(res["out"], ref.detach(), rtol=1e-5, atol=1e-5)
        # Exactly one MAX and one SUM all-reduce, forward and backward together.
        assert sorted(res["calls"]) == sorted([str(dist.ReduceOp.MAX), str(dist.ReduceOp.SUM)]), res["calls"]
    grad = torch.cat([res["grad"] for res in results], dim=1)
    torch.testing.assert_close(grad, full.grad, rtol=1e-5, atol=1e-6)
    assert bool((grad[6] == 0).all())  # padding row


def test_requires_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(LogprobError, match="process group"):
        vocab_parallel_support_logprobs(torch.zeros(1, 4), torch.tensor([[1, 1]]), 1.0)
