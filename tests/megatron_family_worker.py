"""Test helper run under torchrun (gloo): a family room checkpoint (deepseek_v3 / glm4_moe_lite /
deepseek_v32 / glm_moe_dsa) as megatron-core's MLA GPTModel in several layouts of one world, against
transformers; a Hugging Face qwen3_moe checkpoint as the embedded model's GPTModel (its reference
is the embedded model, and rank 0 also writes transformers' own logits, ``transformers_logits``).

Usage: torchrun --nproc-per-node N tests/megatron_family_worker.py OUT LAYOUTS CHECKPOINT...
with LAYOUTS ``tp,ep`` pairs joined by ``/`` (e.g. ``1,1/2,1/1,2``); a CHECKPOINT written
``DIR@LAYOUTS`` is run in its own layouts instead. For each checkpoint and
layout, in one process (the parallel groups are rebuilt between layouts): the full-vocabulary
logits of a fixed batch (gathered over TP), the gathered HF weights' largest difference from the
checkpoint, and R3: the routing transformers
chooses on the original weights (the engine's trace), megatron's own routing after every router
is perturbed, and megatron's routing and logits when it replays that trace. With a DSA indexer
the same for its key slots: the indexer's weights are perturbed too, and the indexer trace is
replayed with the last query of row 0 set to all -1 in every indexed layer (it keeps the
indexer's own choice). Rank 0 also runs transformers (the reference, eager attention): the
logits, the traces, and its logits replaying the traces on the same perturbed weights. Rank 0
writes OUT/result.npz, the keys of checkpoint ``i`` prefixed ``c<i>_``, and ``gdn_*``: one
megatron-core gated DeltaNet layer against transformers' (:func:`_gated_deltanet`).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROUTER_NOISE = 0.5
"""Standard deviation of the noise added to every router weight between record and replay
(the routers' weights are ~0.1 here), enough to flip many of the top-k choices."""

INDEXER_NOISE = 1.0
"""Standard deviation of the noise added to the indexer's projections (``wq_b``, ``wk``,
``weights_proj``; weights ~0.1 here) between record and replay."""


def _perturbed(name: str) -> float:
    """The noise scale of HF weight ``name`` between record and replay (0: unchanged)."""
    if name.endswith("mlp.gate.weight"):
        return ROUTER_NOISE
    if ".indexer." in name and "k_norm" not in name:
        return INDEXER_NOISE
    return 0.0


def main() -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    out, layouts, checkpoints = Path(sys.argv[1]), sys.argv[2].split("/"), sys.argv[3:]
    torch.set_num_threads(1)
    result = {}
    for i, checkpoint in enumerate(checkpoints):
        path, _, own = checkpoint.partition("@")
        for k, v in _compare(Path(path), own.split("/") if own else layouts).items():
            result[f"c{i}_{k}"] = v
    result.update(_gated_deltanet())
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        np.savez(out / "result.npz", **result)
    dist.barrier()


def _compare(checkpoint: Path, layouts: list[str]) -> dict:
    """The values of one checkpoint in every layout (see the module docstring)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from replayrl.rollout.model.loader import load_pretrained
    from replayrl.trainer.backends.megatron_cpu_compat import cpu_device_scope
    from replayrl.trainer.backends.megatron_model import MegatronParallel, build_gpt_model, init_parallel
    from replayrl.trainer.backends.megatron_replay import RoutingReplay
    from replayrl.trainer.backends.megatron_weights import gather_hf_weights, load_hf_weights

    engine, cfg = load_pretrained(checkpoint)
    engine.eval()
    state = {k: v.clone() for k, v in engine.state_dict().items()}  # not views of the engine
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen)
    positions = torch.arange(12).expand_as(tokens)
    perturbed = {k: v + _perturbed(k) * torch.randn(v.shape, generator=gen) if _perturbed(k) else v
                 for k, v in state.items()}
    result = {}
    # gradients of a fixed linear function of the logits (float32), by transformers (the
    # indexer is frozen in both models)
    probe = torch.randn(*tokens.shape, cfg.vocab_size, generator=gen)
    (engine(tokens, positions).logits * probe).sum().backward()
    params = engine.hf.named_parameters() if hasattr(engine, "hf") else engine.named_parameters()
    grads = {k: p.grad.clone() for k, p in params if p.grad is not None}
    engine.zero_grad(set_to_none=True)
    index = None
    with torch.no_grad():
        ref = engine(tokens, positions, capture=True)
        trace = ref.routed_experts  # int32 [B, S, L_moe, K]: the engine's choice
        result["hf_logits"] = ref.logits.numpy()
        if not hasattr(engine, "hf"):  # a qwen3_moe checkpoint loads as the embedded model
            from transformers import AutoModelForCausalLM

            tf = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager",
                                                      dtype=torch.float32).eval()
            result["transformers_logits"] = tf(tokens).logits.numpy()
        result["trace"] = trace.numpy()
        if cfg.indexed_layers:  # int32 [B, S, L_idx, K], -1 = no key
            index = ref.indexer_topk.clone()
            index[0, -1] = -1  # keeps the indexer's own choice
            result["index_trace"] = index.numpy()
        engine.load_state_dict(perturbed)
        replayed = engine(tokens, positions, routed_experts=trace, indexer_topk=index, capture=True)
        result["hf_replay_logits"] = replayed.logits.numpy()
        if index is not None:
            result["hf_replay_index"] = replayed.indexer_topk.numpy()

    for layout in layouts:
        tp, ep = (int(x) for x in layout.split(","))
        parallel = MegatronParallel(tp=tp, ep=ep)
        init_parallel(parallel, seed=1)
        from megatron.core import parallel_state as ps

        def logits_of(model) -> torch.Tensor:
            local = model(tokens, positions, attention_mask=None)  # [B, S, V / tp]
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            return torch.cat(parts, dim=-1)

        name = f"tp{tp}_ep{ep}"
        with cpu_device_scope():
            model, _, indexer = build_gpt_model(cfg, parallel)
            model.eval()
            load_hf_weights(model, state, cfg)
            if ep == 1:  # under EP the data-parallel ranks' tokens meet in the experts
                result[f"{name}_grad_diff"] = _grad_difference(
                    _hf_gradients(model, cfg, tokens, positions, probe, tp), grads)
            if ep == 1 and indexer is not None:
                diff, indexer_grads = _indexer_loss_grads(model, cfg, tokens, positions, probe,
                                                          grads, tp)
                result[f"{name}_kl_grad_diff"] = diff
                result.update({f"{name}_kl_grad.{k}": v for k, v in indexer_grads.items()})
                model.eval()
        with cpu_device_scope(), torch.no_grad():
            replay = RoutingReplay(model, cfg)
            result[f"{name}_logits"] = logits_of(model).numpy()
            back = gather_hf_weights(model, cfg)
            assert set(back) == set(state), sorted(set(back) ^ set(state))[:3]
            result[f"{name}_roundtrip"] = np.array(max(
                float((torch.as_tensor(back[k]) - state[k]).abs().max()) for k in state))
            load_hf_weights(model, perturbed, cfg)
            keys = torch.ones(tokens.shape, dtype=torch.bool)
            replay.begin(None)  # the perturbed routers' and indexers' own choice
            if indexer is not None:
                indexer.begin(keys, None)
            logits_of(model)
            result[f"{name}_own"] = replay.collect(tokens.shape[0])[0].numpy()
            replay.end()
            if indexer is not None:
                result[f"{name}_index_own"] = indexer.collect()[1].numpy()
                indexer.end()
                indexer.begin(keys, index)
            replay.begin(trace)
            result[f"{name}_replay_logits"] = logits_of(model).numpy()
            result[f"{name}_used"] = replay.collect(tokens.shape[0])[0].numpy()
            replay.end()
            if indexer is not None:
                used, own = indexer.collect()
                result[f"{name}_index_used"], result[f"{name}_index_replay_own"] = used.numpy(), own.numpy()
                indexer.end()
    return result


def _gated_deltanet() -> dict:
    """megatron-core's ``GatedDeltaNet`` (Qwen3.5-MoE's linear attention; the model is not built
    on megatron, docs/design/megatron.md#megatron-families) on CPU at TP 1 against transformers'
    ``Qwen3_5MoeGatedDeltaNet`` of the tiny Qwen3.5-MoE text config, with the same random weights
    (std 0.2; decay ``A`` in [1, 16], transformers' range; gated norm weight near 1):
    ``gdn_out`` / ``gdn_hf_out`` ``[B, S, H]`` and the input gradients of ``sum(out * probe)``,
    ``gdn_grad`` / ``gdn_hf_grad``.

    Without flash-linear-attention (``fla``) megatron's constructor raises ImportError and its
    forward calls fla's ``l2norm`` and ``chunk_gated_delta_rule``: bound here to a torch
    ``l2norm`` (FLA's definition, epsilon 1e-6 under the root) and megatron's own
    ``torch_chunk_gated_delta_rule``. transformers' four input projections stack as megatron's
    ``in_proj`` [qkv; z; b; a]; the gated norm's weight is ``out_norm``'s."""
    import torch
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import gated_delta_net as gdn
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    from replayrl.trainer.backends.megatron_cpu_compat import cpu_device_scope
    from replayrl.trainer.backends.megatron_model import MegatronParallel, init_parallel
    from tests.family_checkpoints import tiny_hf_config

    if not gdn.HAVE_FLA:
        gdn.HAVE_FLA = True
        gdn.l2norm = lambda x: x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)
        gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    init_parallel(MegatronParallel(), seed=1)
    c = tiny_hf_config("qwen3_5_moe_text")
    gen = torch.Generator().manual_seed(0)
    ref = Qwen3_5MoeGatedDeltaNet(c, 0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        ref.A_log.copy_(torch.log(1 + 15 * torch.rand(ref.A_log.shape, generator=gen)))
        ref.norm.weight.add_(1.0)
    x = torch.randn(2, 12, c.hidden_size, generator=gen)
    probe = torch.randn(x.shape, generator=gen)
    out = {}
    xr = x.clone().requires_grad_(True)
    y = ref(xr)
    (y * probe).sum().backward()
    out["gdn_hf_out"], out["gdn_hf_grad"] = y.detach().numpy(), xr.grad.numpy()
    config = TransformerConfig(
        num_layers=1, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, add_bias_linear=False,
        activation_func=torch.nn.functional.silu, use_cpu_initialization=True,
        params_dtype=torch.float32, gradient_accumulation_fusion=False, persist_layer_norm=False,
        linear_conv_kernel_dim=c.linear_conv_kernel_dim, linear_key_head_dim=c.linear_key_head_dim,
        linear_value_head_dim=c.linear_value_head_dim, linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads)
    local = LocalSpecProvider()
    sub = gdn.GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear,
                                      out_norm=local.layer_norm(rms_norm=True),
                                      out_proj=local.row_parallel_linear())
    w = dict(ref.named_parameters())
    weights = {"in_proj.weight": torch.cat([w[f"in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")]),
               "out_norm.weight": w["norm.weight"]}
    with cpu_device_scope():
        layer = gdn.GatedDeltaNet(config, sub, layer_number=1,
                                  pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(weights.get(name, w.get(name)))
        xm = x.transpose(0, 1).contiguous().requires_grad_(True)  # [S, B, H]
        y, _ = layer(xm, None)
        (y.transpose(0, 1) * probe).sum().backward()
    out["gdn_out"] = y.transpose(0, 1).detach().numpy()
    out["gdn_grad"] = xm.grad.transpose(0, 1).numpy()
    return out


def _hf_gradients(model, cfg, tokens, positions, probe, tp: int) -> dict:
    """megatron's gradients of ``sum(logits * probe)`` under HF names, whole (numpy or torch
    arrays by HF weight name, as ``gather_hf_weights`` returns). Each TP rank takes its
    vocabulary shard of the probe; the gradients of sequence-parallel weights (norms, routers:
    each rank saw its slice of the tokens) are summed over TP, as ``finalize_model_grads``
    does; then the shards are gathered like weights. The parameters are restored and their
    gradients dropped."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from replayrl.trainer.backends.megatron_weights import gather_hf_weights

    local = model(tokens, positions, attention_mask=None)  # [B, S, V / tp]
    rank = ps.get_tensor_model_parallel_rank()
    (local * probe.chunk(tp, dim=-1)[rank]).sum().backward()
    saved = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if tp > 1 and getattr(p, "sequence_parallel", False):
                dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
            saved[name] = p.data
            p.data = g
    got = gather_hf_weights(model, cfg)  # the gradients, gathered and renamed as weights
    for name, p in model.named_parameters():
        p.data = saved[name]
        p.grad = None
    return got


def _grad_difference(got: dict, grads: dict):
    """Largest difference of megatron's gradients ``got`` (:func:`_hf_gradients`) from
    transformers' ``grads`` (HF names, torch), relative to the largest entry of ``grads``:
    a float64 numpy scalar."""
    import numpy as np
    import torch

    scale = max(float(g.abs().max()) for g in grads.values())
    return np.array(max(float((torch.as_tensor(got[k]) - g).abs().max()) for k, g in grads.items())
                    / scale)


def _indexer_loss_grads(model, cfg, tokens, positions, probe, grads: dict, tp: int):
    """With megatron-core's indexer KL loss on (``train_indexer``, coefficient 1, a training
    forward): the largest difference of the policy's gradients of ``sum(logits * probe)`` from
    transformers' frozen-indexer ``grads`` (relative, as :func:`_grad_difference`) and the
    indexer weights' gradients under HF names (the loss reaches only them)."""
    import numpy as np

    from replayrl.trainer.backends.megatron_dsa import train_indexer

    train_indexer(model, 1.0)
    model.train()
    got = _hf_gradients(model, cfg, tokens, positions, probe, tp)
    for name, p in model.named_parameters():
        if ".indexer." in name:
            p.requires_grad_(False)  # frozen again, as built
    return _grad_difference(got, grads), {k: np.asarray(v) for k, v in got.items() if ".indexer." in k}


if __name__ == "__main__":
    main()
