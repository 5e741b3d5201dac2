"""Test helper run as each of two ranks (gloo, CPU; torchrun's environment: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): one replayed step of ``--train-backend fsdp`` at
DP=2 on family checkpoints, every rank on its half of a fixed batch
(tests/system/test_fsdp_ranks_families.py compares it with the DP=1 step).

Usage: torchrun --nproc-per-node 2 tests/fsdp_family_worker.py OUT CHECKPOINT... (or the two
processes started with that environment, as the test does)

For each checkpoint, in one world (the backends are built one after another): the batch of
:func:`step_batch` (the engine's own routing / indexer choices as traces, support replay on),
rank ``r`` training samples ``[2r, 2r + 2)`` with :func:`step_loss`; the preflight's logprobs
and replay flips, the gradient norm, the weights and AdamW's first moments (gathered from the
shards) after the step. Rank 0 writes ``OUT/result.npz``, the keys of checkpoint ``i`` prefixed
``c<i>_``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SAMPLES = 4
"""Samples in the batch (two groups of two); each of the two ranks trains two."""


def step_batch(checkpoint: Path, lo: int = 0, hi: int = SAMPLES):
    """The collated batch of samples ``[lo, hi)`` of tests/backend_fixtures.py's
    ``traced_samples`` on the checkpoint's fp32 model (routing, indexer where the family has
    one, support), and the loss weights of their response tokens (float32 [N]): the same slice
    of ``linspace(-1, 1)`` over the whole batch's tokens, so the ranks' losses sum to the
    one-rank loss."""
    import torch

    from replayrl.rollout.model.loader import load_pretrained
    from replayrl.trainer.batching.batch import collate
    from tests.backend_fixtures import traced_samples

    engine, cfg = load_pretrained(checkpoint)
    samples = traced_samples(engine.eval(), cfg.vocab_size, prompt_len=6)
    sizes = [len(s.response_ids) for s in samples]
    weights = torch.linspace(-1.0, 1.0, sum(sizes))
    batch = collate(samples[lo:hi], routing=True, indexer=bool(cfg.indexed_layers), support=True)
    return batch, weights[sum(sizes[:lo]):sum(sizes[:hi])]


def step_loss(weights, ranks: int):
    """``-(logp * weights).sum() * ranks``: FSDP averages the ranks' gradients, so each rank's
    share is scaled by the rank count to sum to the one-rank gradient."""
    return lambda logp: -(logp * weights).sum() * ranks


def one_step(backend, batch, weights, ranks: int) -> dict:
    """Preflight, then one step clipped at 1.0: the logprobs (float32 [N]), the flip rates of the
    used routing / indexer choices against the batch's traces, the gradient norm, and the
    gathered weights and AdamW ``exp_avg`` after the step (float32 numpy by parameter name,
    prefixed ``param/`` and ``opt/``); and the weights before the step (``param/``)."""
    import numpy as np
    import torch

    from replayrl.trainer.backends.shards import full_value
    from replayrl.trainer.replay.checks import batch_flip_rate

    with torch.no_grad():
        start = {f"param/{name}": full_value(p).detach().float().numpy().copy()
                 for name, p in backend.model.named_parameters() if p.requires_grad}
    pre = backend.preflight_logprobs(batch)
    real = batch.key_padding_mask
    out = {"logprobs": pre.logprobs.numpy(),
           "routing_flips": batch_flip_rate(batch.routed_experts, pre.routed_experts, real),
           "indexer_flips": (0.0 if batch.indexer_topk is None
                             else batch_flip_rate(batch.indexer_topk, pre.indexer_topk, real))}
    backend.zero_grad()
    backend.forward_backward(batch, step_loss(weights, ranks))
    out["grad_norm"] = np.float64(backend.clip_and_step(1.0))
    with torch.no_grad():
        for name, p in backend.model.named_parameters():
            if not p.requires_grad:
                continue
            out[f"param/{name}"] = full_value(p).detach().float().numpy().copy()
            out[f"opt/{name}"] = full_value(backend.optimizer.state[p]["exp_avg"]).float().numpy().copy()
    return out, start


def main() -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from replayrl.trainer.backends.fsdp_backend import FSDPBackend
    from replayrl.trainer.config import TrainerConfig

    out, checkpoints = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    share = SAMPLES // ranks
    result = {}
    for i, checkpoint in enumerate(checkpoints):
        batch, weights = step_batch(Path(checkpoint), rank * share, (rank + 1) * share)
        backend = FSDPBackend(checkpoint, TrainerConfig(train_backend="fsdp", dp_size=ranks), [])
        got, _ = one_step(backend, batch, weights, ranks)
        parts = [None] * ranks
        dist.all_gather_object(parts, (got.pop("logprobs"), got.pop("routing_flips"), got.pop("indexer_flips")))
        got["logprobs"] = np.concatenate([p[0] for p in parts])
        got["routing_flips"] = np.array([p[1] for p in parts])
        got["indexer_flips"] = np.array([p[2] for p in parts])
        result.update({f"c{i}_{k}": v for k, v in got.items()})
        del backend
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        np.savez(out / "result.npz", **result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
