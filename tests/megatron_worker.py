"""Test helper run under torchrun (gloo): one MegatronBackend per rank on the tests' checkpoint.

Usage: torchrun --nproc-per-node N tests/megatron_worker.py CHECKPOINT OUT --case main|r3|pp|ckpt
[--tp N] [--ep N] [--pp N] [--cp N] [--split-data] [--perturb-last-stage]
[--family DIR]... [--family-layouts one/pp2/cp2]

``main``: preflight logprobs and routing (support replay + R3 trace, and full vocabulary without
replay), the gathered weights, one optimizer step (``forward_backward``; grad norm, weights
after); also the routers' own recorded choice replayed (``self_*``: the choice used, the own
choice and the logprobs of that forward). With ``--family DIR`` (a family room checkpoint,
repeatable) the ``main`` values of each family checkpoint follow, in each of
``--family-layouts`` (``one``: one rank's layout, ``ppN`` / ``cpN``: N pipeline stages /
context-parallel ranks; the parallel groups are rebuilt in the same processes), under
``<DIR's name>/<layout>/``, with the replayed trace as ``<DIR's name>/trace``.
``r3``: record the routing, perturb the routers (only the last pipeline stage's with
``--perturb-last-stage``), forward without and with replay of the recorded routing.
``pp``: the routing replay targets each pipeline stage feeds its routers, the indexer trace
stream each stage's indexed layers read (``istream<rank>_<layer>``), and the error of a stage
asked for another stage's layer (``foreign<rank>``). ``ckpt``: one step, save, a fresh backend
loads it (version and digest compared). ``rebuilt``: a second backend is
built in the process after the first; the first replays the trace (support + R3 + indexer) with
the second alive, then with it dropped; then a second ``RoutingReplay`` over the first's model
takes its routers and the first's replay must refuse (the error's class and message recorded).
Rank 0 writes OUT/result.npz (all ranks' values must agree; the worker checks that itself).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--case", default="main")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--split-data", action="store_true")
    ap.add_argument("--perturb-last-stage", action="store_true")
    ap.add_argument("--family", action="append", default=[])
    ap.add_argument("--family-layouts", default="one")
    args = ap.parse_args()

    import numpy as np
    import torch
    import torch.distributed as dist

    from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
    from replayrl.trainer.backends.megatron_model import MegatronParallel
    from replayrl.trainer.batching.batch import collate
    from replayrl.trainer.config import TrainerConfig
    from tests import megatron_cases as cases

    torch.set_num_threads(1)
    parallel = MegatronParallel(tp=args.tp, ep=args.ep, pp=args.pp, cp=args.cp)
    result = {}
    if args.case == "pp":
        from replayrl.trainer.backends.megatron_model import build_gpt_model, init_parallel
        from replayrl.trainer.backends.megatron_replay import RoutingReplay

        init_parallel(parallel, seed=1)
        model, _, indexer = build_gpt_model(cases.config(), parallel)
        replay = RoutingReplay(model, cases.config())
        batch = collate(cases.samples(cases.perturbed(Path(args.checkpoint))), routing=True,
                        indexer=True, support=False)
        targets = replay.router_targets(batch.routed_experts)
        rank = dist.get_rank()
        result[f"layers{rank}"] = np.array(replay.layers)
        result[f"indexed{rank}"] = np.array(indexer.layers)
        for layer, t in zip(replay.layers, targets):
            result[f"target{rank}_{layer}"] = t.numpy()
        for layer in indexer.layers:  # what IndexerReplay.mask replays on this global layer
            result[f"istream{rank}_{layer}"] = indexer.registry.stream(batch.indexer_topk, layer).numpy()
        foreign = next(i for i in cases.config().indexed_layers if i not in indexer.layers)
        try:
            indexer.registry.stream(batch.indexer_topk, foreign)
            result[f"foreign{rank}"] = np.array("")
        except Exception as e:  # noqa: BLE001 -- the test checks the class by name
            result[f"foreign{rank}"] = np.array(f"{type(e).__name__}: {e}")
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        result = {k: v for part in gathered for k, v in part.items()}
        result["trace"] = batch.routed_experts.numpy()
    else:
        from replayrl.trainer.backends.megatron_backend import MegatronBackend

        cfg = TrainerConfig(temperature=0.8, lr=1e-2)
        backend = MegatronBackend(args.checkpoint, cfg, list(VOCABULARY), parallel=parallel)
        engine = cases.perturbed(Path(args.checkpoint))
        samples = cases.samples(engine)
        if args.split_data:
            samples = samples[dist.get_rank()::dist.get_world_size()]
        replayed = collate(samples, routing=True, indexer=True, support=True)
        plain = collate(samples, routing=False, indexer=False, support=False)
        if args.case == "main":
            result.update(_main_values(backend, replayed, plain))
            result.update({f"w0/{k}": v for k, v in backend.weights().items()})
            result.update(_step_values(backend, replayed))
            for family in map(Path, args.family):
                values = _family_values(family, cfg, args.family_layouts.split("/"))
                result.update({f"{family.name}/{k}": v for k, v in values.items()})
        elif args.case == "ckpt":
            backend.zero_grad()
            backend.forward_backward(replayed, lambda logp: -logp.sum())
            backend.clip_and_step(1.0)
            directory = Path(args.out) / "ckpt"
            directory.mkdir(exist_ok=True)
            backend.save_checkpoint(directory, 5)
            before = backend.digest()
            fresh = MegatronBackend(args.checkpoint, cfg, list(VOCABULARY), parallel=parallel)
            assert fresh.digest() != before
            result["version"] = np.array(fresh.load_checkpoint(directory))
            after = fresh.digest()
            result["same_keys"] = np.array(sorted(before) == sorted(after))
            result["same_values"] = np.array(all(before[k] == after[k] for k in before))
            # each rank holds its shard of the distributed optimizer's moments
            result["opt_keys"] = np.array(any(k.startswith("opt/") for k in before))
        elif args.case == "rebuilt":
            import gc

            second = MegatronBackend(args.checkpoint, cfg, list(VOCABULARY), parallel=parallel)
            a = backend.preflight_logprobs(replayed)
            result.update(logp_alive=a.logprobs.numpy(), used_alive=a.routed_experts.numpy(),
                          index_alive=a.indexer_topk.numpy())
            del second
            gc.collect()
            a = backend.preflight_logprobs(replayed)
            result.update(logp_dropped=a.logprobs.numpy(), used_dropped=a.routed_experts.numpy())
            from replayrl.trainer.backends.megatron_replay import RoutingReplay

            RoutingReplay(backend.model, backend.model_config)  # re-arms the first model's routers
            try:
                backend.preflight_logprobs(replayed)
                result["refused"] = np.array("")
            except Exception as e:  # noqa: BLE001 -- the test checks the class by name
                result["refused"] = np.array(f"{type(e).__name__}: {e}")
        else:  # r3
            from megatron.core import parallel_state as ps

            rec = backend.preflight_logprobs(plain)  # routers record their own choice
            perturb = not args.perturb_last_stage or ps.is_pipeline_last_stage()
            with torch.no_grad():
                g = torch.Generator().manual_seed(11)
                for name, p in backend.model.named_parameters():
                    if perturb and name.endswith("mlp.router.weight"):
                        p.add_(torch.randn(p.shape, generator=g) * 0.05)
            batch = collate(samples, routing=False, indexer=False, support=True)
            import dataclasses

            free = backend.preflight_logprobs(batch)
            again = backend.preflight_logprobs(dataclasses.replace(batch, routed_experts=rec.routed_experts))
            result.update(recorded=rec.routed_experts.numpy(), free=free.routed_experts.numpy(),
                          used=again.routed_experts.numpy(), own=again.own_routed_experts.numpy(),
                          logp=again.logprobs.numpy())
            result.update({f"w/{k}": v for k, v in backend.weights().items()})
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {k: v for k, v in result.items() if not k.startswith("w")})
        if not args.split_data:
            for other in gathered[1:]:
                for k, v in other.items():
                    assert np.array_equal(v, gathered[0][k]), f"ranks disagree on {k}"
        else:
            for r, part in enumerate(gathered):
                result.update({f"rank{r}/{k}": v for k, v in part.items()})
    if dist.get_rank() == 0:
        np.savez(Path(args.out) / "result.npz", **result)
    dist.barrier()
    dist.destroy_process_group()


def _main_values(backend, replayed, plain) -> dict:
    """The ``main`` case's preflight values (module docstring), numpy."""
    import dataclasses

    a = backend.preflight_logprobs(replayed)
    b = backend.preflight_logprobs(plain)  # the routers' own choice, recorded
    # replaying that recorded choice: every router must get back the rows of its own tokens
    c = backend.preflight_logprobs(dataclasses.replace(plain, routed_experts=b.routed_experts))
    out = dict(logp_replay=a.logprobs.numpy(), used=a.routed_experts.numpy(),
               own=a.own_routed_experts.numpy(), logp_plain=b.logprobs.numpy(),
               plain_used=b.routed_experts.numpy(), self_used=c.routed_experts.numpy(),
               self_own=c.own_routed_experts.numpy(), self_logp=c.logprobs.numpy())
    if a.indexer_topk is not None:
        out.update(index_used=a.indexer_topk.numpy(), index_own=a.own_indexer_topk.numpy())
    return out


def _step_values(backend, replayed) -> dict:
    """One clipped optimizer step of ``-sum(logprobs)``: its gradient norm, the weights after."""
    import numpy as np

    backend.zero_grad()
    backend.forward_backward(replayed, lambda logp: -logp.sum())
    out = {"grad_norm": np.array(backend.clip_and_step(1.0))}
    out.update({f"w1/{k}": v for k, v in backend.weights().items()})
    return out


def _family_values(checkpoint: Path, cfg, layouts: list[str]) -> dict:
    """The ``main`` values of a family room checkpoint in each of ``layouts`` (``one``,
    ``pp<N>``, ``cp<N>``; keys prefixed ``<layout>/``), on samples whose routing the
    checkpoint's transformers model (routers perturbed) chose."""
    from replayrl.trainer.backends.megatron_backend import MegatronBackend
    from replayrl.trainer.backends.megatron_model import MegatronParallel
    from replayrl.trainer.batching.batch import collate
    from tests import megatron_cases as cases

    samples = cases.samples(cases.perturbed(checkpoint))
    replayed = collate(samples, routing=True, indexer=False, support=True)
    plain = collate(samples, routing=False, indexer=False, support=False)
    out = {"trace": replayed.routed_experts.numpy()}
    for layout in layouts:
        size = {layout[:2]: int(layout[2:])} if layout != "one" else {}
        backend = MegatronBackend(str(checkpoint), cfg, [], parallel=MegatronParallel(**size))
        values = {**_main_values(backend, replayed, plain), **_step_values(backend, replayed)}
        out.update({f"{layout}/{k}": v for k, v in values.items()})
    return out


if __name__ == "__main__":
    main()
