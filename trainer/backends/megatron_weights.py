"""Weight conversion both ways between Hugging Face Qwen3-MoE names and megatron-core's GPTModel.

The engines load Hugging Face names (:func:`replayrl.rollout.model.checkpoint.state_dict_arrays`); the
megatron trainer holds each rank's shard of a ``GPTModel`` built by
:func:`replayrl.trainer.backends.megatron_model.build_gpt_model`. The mapping
(docs/design/megatron.md#megatron-backend), per global layer ``i`` and global expert ``e``:

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

A family room policy (``FamilyConfig``: DeepSeek-V3 / GLM-4.7-Flash) has its own table in
:mod:`replayrl.trainer.backends.megatron_mla_weights`; the sharding here serves both, and the
routers' ``expert_bias`` buffers (not parameters) travel with the weights.
"""
from __future__ import annotations

import re

import numpy as np
import torch
import torch.distributed as dist

from replayrl.rollout.model.config import ModelConfig
from replayrl.trainer.errors import WeightMapError

__all__ = [ "hf_to_megatron", "megatron_to_hf", "load_hf_weights",
           "gather_hf_weights"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_INDEXER = ("wq.weight", "wk.weight", "weights_proj.weight")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


def _need(state: dict, name: str) -> torch.Tensor:
    if name not in state:
        raise WeightMapError(f"weight {name!r} missing from the Hugging Face state dict")
    return torch.as_tensor(state[name])


def _layout(config: ModelConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]],
                                         list[tuple[str, str, str, str]]]:
    """The name map of one policy, read by both directions of the conversion:
    ``(renamed, fc1, qkv)`` with ``renamed`` = ``(hf, megatron)`` pairs of tensors that only
    change name, ``fc1`` = ``(megatron, hf gate, hf up)`` (gate and up stacked along dim 0) and
    ``qkv`` = ``(megatron, hf q, hf k, hf v)`` (interleaved per KV group, megatron's layout)."""
    c = config
    renamed = [("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
               ("model.norm.weight", "decoder.final_layernorm.weight"),
               ("lm_head.weight", "output_layer.weight")]
    fc1, qkv = [], []
    for i in range(c.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        renamed += [(hf + "input_layernorm.weight", mg + "input_layernorm.weight"),
                    (hf + "post_attention_layernorm.weight", mg + "pre_mlp_layernorm.weight"),
                    (hf + "self_attn.o_proj.weight", mg + "self_attention.linear_proj.weight"),
                    (hf + "self_attn.q_norm.weight", mg + "self_attention.q_layernorm.weight"),
                    (hf + "self_attn.k_norm.weight", mg + "self_attention.k_layernorm.weight")]
        qkv.append((mg + "self_attention.linear_qkv.weight", hf + "self_attn.q_proj.weight",
                    hf + "self_attn.k_proj.weight", hf + "self_attn.v_proj.weight"))
        if i in c.indexed_layers:
            renamed += [(f"{hf}self_attn.indexer.{w}", f"{mg}self_attention.indexer.{w}")
                        for w in _INDEXER]
        if i in c.moe_layers:
            renamed.append((hf + "mlp.gate.weight", mg + "mlp.router.weight"))
            for e in range(c.num_experts):
                he, me = f"{hf}mlp.experts.{e}.", f"{mg}mlp.experts.local_experts.{e}."
                fc1.append((me + "linear_fc1.weight", he + "gate_proj.weight", he + "up_proj.weight"))
                renamed.append((he + "down_proj.weight", me + "linear_fc2.weight"))
        else:
            fc1.append((mg + "mlp.linear_fc1.weight", hf + "mlp.gate_proj.weight",
                        hf + "mlp.up_proj.weight"))
            renamed.append((hf + "mlp.down_proj.weight", mg + "mlp.linear_fc2.weight"))
    return renamed, fc1, qkv


def hf_to_megatron(state: dict, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Unsharded megatron-named tensors (global layer and expert ids) from HF-named weights.

    Args:
        state: HF name -> tensor / numpy array (float), the full policy.

    Raises:
        WeightMapError: a missing HF weight.
    """
    if not isinstance(config, ModelConfig):  # a family room policy
        from replayrl.trainer.backends.megatron_mla_weights import mla_hf_to_megatron

        return mla_hf_to_megatron(state, config)
    g, d, h = config.num_key_value_heads, config.head_dim, config.hidden_size
    renamed, fc1, qkv = _layout(config)
    out = {mg: _need(state, hf) for hf, mg in renamed}
    for mg, gate, up in fc1:
        out[mg] = torch.cat([_need(state, gate), _need(state, up)])
    for mg, q, k, v in qkv:
        out[mg] = torch.cat([_need(state, q).reshape(g, -1, h), _need(state, k).reshape(g, d, h),
                             _need(state, v).reshape(g, d, h)], dim=1).reshape(-1, h)
    return out


def megatron_to_hf(full: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """Inverse of :func:`hf_to_megatron`: HF-named read-only float32 arrays.

    Raises:
        WeightMapError: a missing megatron weight.
    """
    if not isinstance(config, ModelConfig):  # a family room policy
        from replayrl.trainer.backends.megatron_mla_weights import mla_megatron_to_hf

        return mla_megatron_to_hf(full, config)
    g, d, h = config.num_key_value_heads, config.head_dim, config.hidden_size
    qd = config.num_attention_heads // g * d
    renamed, fc1, qkv = _layout(config)
    out = {hf: _need(full, mg) for hf, mg in renamed}
    for mg, gate, up in fc1:
        out[gate], out[up] = _need(full, mg).chunk(2)
    for mg, q, k, v in qkv:
        t = _need(full, mg).reshape(g, qd + 2 * d, h)
        out[q], out[k], out[v] = (t[:, :qd].reshape(-1, h), t[:, qd:qd + d].reshape(-1, h),
                                  t[:, qd + d:].reshape(-1, h))
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


def _tensors(model):
    """``(local name, tensor)`` of every parameter and of the routers' ``expert_bias`` buffers
    (a family's bias correction: in the checkpoint, not trained)."""
    yield from model.named_parameters()
    for local, buf in model.named_buffers():
        if local.endswith("router.expert_bias"):
            yield local, buf


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
        for local, param in _tensors(model):
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
        for local, param in _tensors(model):
            mine[_global_name(model, local)] = _unshard(param.detach(), param, local).clone()
    world = dist.get_world_size()
    from megatron.core import parallel_state as ps

    if (ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
            * ps.get_expert_model_parallel_world_size()) == 1:
        return megatron_to_hf(mine, config)  # one rank, or data-parallel replicas: all here
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    full = {}
    for part in gathered:
        for k, v in part.items():
            full.setdefault(k, v)
    return megatron_to_hf(full, config)
