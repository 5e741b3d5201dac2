"""Weight conversion both ways between Hugging Face Qwen3-MoE names and megatron-core's GPTModel.

The engines load Hugging Face names (:func:`rollout.model.checkpoint.state_dict_arrays`); the
megatron trainer holds each rank's shard of a ``GPTModel`` built by
:func:`trainer.backends.megatron_model.build_gpt_model`. The mapping (docs/design.md §16 "The megatron-core backend"), per global layer ``i`` and global expert ``e``:

======================================================  ==============================================
Hugging Face                                            megatron-core (unsharded)
======================================================  ==============================================
``model.embed_tokens.weight``                           ``embedding.word_embeddings.weight``
``model.layers.i.input_layernorm.weight``               ``decoder.layers.i.input_layernorm.weight``
``...self_attn.{q,k,v}_proj.weight``                    ``...self_attention.linear_qkv.weight`` (per
                                                        query group: its q heads, then k, then v)
``...self_attn.o_proj.weight``                          ``...self_attention.linear_proj.weight``
``...self_attn.{q,k}_norm.weight``                      ``...self_attention.{q,k}_layernorm.weight``
``...self_attn.indexer.*`` (indexed layers)             ``...self_attention.indexer.*``
``...post_attention_layernorm.weight``                  ``...pre_mlp_layernorm.weight``
``...mlp.{gate,up}_proj.weight`` (dense)                ``...mlp.linear_fc1.weight`` ([gate; up])
``...mlp.down_proj.weight`` (dense)                     ``...mlp.linear_fc2.weight``
``...mlp.gate.weight`` (MoE)                            ``...mlp.router.weight``
``...mlp.experts.e.{gate,up,down}_proj.weight``         ``...mlp.experts.local_experts.e.linear_fc{1,2}``
``model.norm.weight``                                   ``decoder.final_layernorm.weight``
``lm_head.weight``                                      ``output_layer.weight``
======================================================  ==============================================

Sharding of a rank's parameters: layer ``j`` of a pipeline stage is global layer
``layer_number - 1``; local expert ``j`` of expert-parallel rank ``r`` is global expert
``r * E_local + j``; tensor-parallel parameters are the ``partition_dim`` chunk of the rank
(``linear_fc1``: the chunk of gate and the chunk of up, concatenated, as megatron's SwiGLU
shards them); expert parameters use the expert-tensor-parallel rank.
"""
from __future__ import annotations

import re

import numpy as np
import torch
import torch.distributed as dist

from rollout.model.config import ModelConfig

__all__ = ["WeightMapError", "hf_to_megatron", "megatron_to_hf", "load_hf_weights",
           "gather_hf_weights"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_INDEXER = ("wq.weight", "wk.weight", "weights_proj.weight")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


class WeightMapError(ValueError):
    """A weight set whose names or shapes do not match the model; names the parameter."""


def _need(state: dict, name: str) -> torch.Tensor:
    if name not in state:
        raise WeightMapError(f"weight {name!r} missing from the Hugging Face state dict")
    return torch.as_tensor(state[name])


def hf_to_megatron(state: dict, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Unsharded megatron-named tensors (global layer and expert ids) from HF-named weights.

    Args:
        state: HF name -> tensor / numpy array (float), the full policy.

    Raises:
        WeightMapError: a missing HF weight.
    """
    c, out = config, {}
    g, d, h = c.num_key_value_heads, c.head_dim, c.hidden_size
    out["embedding.word_embeddings.weight"] = _need(state, "model.embed_tokens.weight")
    out["decoder.final_layernorm.weight"] = _need(state, "model.norm.weight")
    out["output_layer.weight"] = _need(state, "lm_head.weight")
    for i in range(c.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mg + "input_layernorm.weight"] = _need(state, hf + "input_layernorm.weight")
        out[mg + "pre_mlp_layernorm.weight"] = _need(state, hf + "post_attention_layernorm.weight")
        q = _need(state, hf + "self_attn.q_proj.weight").reshape(g, -1, h)
        k = _need(state, hf + "self_attn.k_proj.weight").reshape(g, d, h)
        v = _need(state, hf + "self_attn.v_proj.weight").reshape(g, d, h)
        out[mg + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
        out[mg + "self_attention.linear_proj.weight"] = _need(state, hf + "self_attn.o_proj.weight")
        out[mg + "self_attention.q_layernorm.weight"] = _need(state, hf + "self_attn.q_norm.weight")
        out[mg + "self_attention.k_layernorm.weight"] = _need(state, hf + "self_attn.k_norm.weight")
        if i in c.indexed_layers:
            for w in _INDEXER:
                out[f"{mg}self_attention.indexer.{w}"] = _need(state, f"{hf}self_attn.indexer.{w}")
        if i in c.moe_layers:
            out[mg + "mlp.router.weight"] = _need(state, hf + "mlp.gate.weight")
            for e in range(c.num_experts):
                he, me = f"{hf}mlp.experts.{e}.", f"{mg}mlp.experts.local_experts.{e}."
                out[me + "linear_fc1.weight"] = torch.cat(
                    [_need(state, he + "gate_proj.weight"), _need(state, he + "up_proj.weight")])
                out[me + "linear_fc2.weight"] = _need(state, he + "down_proj.weight")
        else:
            out[mg + "mlp.linear_fc1.weight"] = torch.cat(
                [_need(state, hf + "mlp.gate_proj.weight"), _need(state, hf + "mlp.up_proj.weight")])
            out[mg + "mlp.linear_fc2.weight"] = _need(state, hf + "mlp.down_proj.weight")
    return out


def megatron_to_hf(full: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """Inverse of :func:`hf_to_megatron`: HF-named read-only float32 arrays.

    Raises:
        WeightMapError: a missing megatron weight.
    """
    c, out = config, {}
    g, d, h = c.num_key_value_heads, c.head_dim, c.hidden_size
    qd = c.num_attention_heads // g * d
    out["model.embed_tokens.weight"] = _need(full, "embedding.word_embeddings.weight")
    out["model.norm.weight"] = _need(full, "decoder.final_layernorm.weight")
    out["lm_head.weight"] = _need(full, "output_layer.weight")
    for i in range(c.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[hf + "input_layernorm.weight"] = _need(full, mg + "input_layernorm.weight")
        out[hf + "post_attention_layernorm.weight"] = _need(full, mg + "pre_mlp_layernorm.weight")
        qkv = _need(full, mg + "self_attention.linear_qkv.weight").reshape(g, qd + 2 * d, h)
        out[hf + "self_attn.q_proj.weight"] = qkv[:, :qd].reshape(-1, h)
        out[hf + "self_attn.k_proj.weight"] = qkv[:, qd:qd + d].reshape(-1, h)
        out[hf + "self_attn.v_proj.weight"] = qkv[:, qd + d:].reshape(-1, h)
        out[hf + "self_attn.o_proj.weight"] = _need(full, mg + "self_attention.linear_proj.weight")
        out[hf + "self_attn.q_norm.weight"] = _need(full, mg + "self_attention.q_layernorm.weight")
        out[hf + "self_attn.k_norm.weight"] = _need(full, mg + "self_attention.k_layernorm.weight")
        if i in c.indexed_layers:
            for w in _INDEXER:
                out[f"{hf}self_attn.indexer.{w}"] = _need(full, f"{mg}self_attention.indexer.{w}")
        if i in c.moe_layers:
            out[hf + "mlp.gate.weight"] = _need(full, mg + "mlp.router.weight")
            for e in range(c.num_experts):
                he, me = f"{hf}mlp.experts.{e}.", f"{mg}mlp.experts.local_experts.{e}."
                gate, up = _need(full, me + "linear_fc1.weight").chunk(2)
                out[he + "gate_proj.weight"], out[he + "up_proj.weight"] = gate, up
                out[he + "down_proj.weight"] = _need(full, me + "linear_fc2.weight")
        else:
            gate, up = _need(full, mg + "mlp.linear_fc1.weight").chunk(2)
            out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
            out[hf + "mlp.down_proj.weight"] = _need(full, mg + "mlp.linear_fc2.weight")
    arrays = {}
    for k, v in out.items():
        a = np.ascontiguousarray(v.detach().float().numpy())
        a.flags.writeable = False
        arrays[k] = a
    return arrays


# --------------------------------------------------------------------------- rank shards


def _global_name(model, local: str) -> str:
    """The unsharded megatron name of local parameter ``local`` (global layer / expert ids)."""
    from megatron.core import parallel_state as ps

    m = _LAYER.match(local)
    if m is None:
        return local
    j, rest = int(m.group(1)), m.group(2)
    layer = model.decoder.layers[j].layer_number - 1
    e = _EXPERT.match(rest)
    if e is not None:
        n_local = len(model.decoder.layers[j].mlp.experts.local_experts)
        expert = ps.get_expert_model_parallel_rank() * n_local + int(e.group(1))
        rest = f"mlp.experts.local_experts.{expert}.{e.group(2)}"
    return f"decoder.layers.{layer}.{rest}"


def _tp_group(local: str):
    """(rank, size, group) of the tensor-parallel group that shards parameter ``local``."""
    from megatron.core import parallel_state as ps

    if ".mlp.experts." in local:
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


def _shard(full: torch.Tensor, param, local: str) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    rank, size, _ = _tp_group(local)
    dim = param.partition_dim
    if local.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=dim)[rank]


def _unshard(local_value: torch.Tensor, param, local: str) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return local_value
    _, size, group = _tp_group(local)
    if size == 1:
        return local_value
    parts = [torch.empty_like(local_value) for _ in range(size)]
    dist.all_gather(parts, local_value.contiguous(), group=group)
    if local.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=param.partition_dim)


def load_hf_weights(model, state: dict, config: ModelConfig) -> None:
    """Copy this rank's shard of HF-named ``state`` (the full policy) into ``model`` in place.

    Raises:
        WeightMapError: a missing weight, or a shard whose shape differs from the parameter.
    """
    full = hf_to_megatron(state, config)
    with torch.no_grad():
        for local, param in model.named_parameters():
            name = _global_name(model, local)
            if name not in full:
                raise WeightMapError(f"megatron parameter {local!r} ({name}) has no HF weight")
            value = _shard(full[name].float(), param, local)
            if tuple(value.shape) != tuple(param.shape):
                raise WeightMapError(f"megatron parameter {local!r}: shard {tuple(value.shape)} "
                                     f"!= parameter {tuple(param.shape)}")
            param.copy_(value)


def gather_hf_weights(model, config: ModelConfig) -> dict[str, np.ndarray]:
    """The full policy under HF names, assembled from every rank's shards.

    A collective: every rank of the world must call it; every rank gets the same dict.
    Tensor-parallel shards are all-gathered in their groups, then pipeline stages and expert
    ranks exchange their (unsharded) tensors with one ``all_gather_object``.

    Raises:
        WeightMapError: a weight missing on every rank.
    """
    mine = {}
    with torch.no_grad():
        for local, param in model.named_parameters():
            mine[_global_name(model, local)] = _unshard(param.detach(), param, local).clone()
    world = dist.get_world_size()
    if world == 1:
        return megatron_to_hf(mine, config)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    full = {}
    for part in gathered:
        for k, v in part.items():
            full.setdefault(k, v)
    return megatron_to_hf(full, config)
