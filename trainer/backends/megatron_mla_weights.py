"""Weight conversion both ways between the MLA families' Hugging Face names and megatron-core's
MLA ``GPTModel`` (:mod:`replayrl.trainer.backends.megatron_mla`).

``deepseek_v3``, ``glm4_moe_lite``, ``deepseek_v32`` and ``glm_moe_dsa`` share transformers'
names (its in-memory layout: each MoE layer's experts fused into ``gate_up_proj``
``[E, 2I, H]`` = [gate; up] per expert and ``down_proj`` ``[E, H, I]``). The table, per global
layer ``i`` and global expert ``e`` (HF prefix ``model.layers.i.``, megatron prefix ``decoder.layers.i.``):

======================================================  ==============================================
Hugging Face                                            megatron-core (unsharded)
======================================================  ==============================================
``model.embed_tokens.weight``                           ``embedding.word_embeddings.weight``
``input_layernorm.weight``                              ``input_layernorm.weight``
``self_attn.q_a_proj.weight``                           ``self_attention.linear_q_down_proj.weight``
``self_attn.q_a_layernorm.weight``                      ``self_attention.q_layernorm.weight``
``self_attn.q_b_proj.weight``                           ``self_attention.linear_q_up_proj.weight``
``self_attn.q_proj.weight`` (no ``q_lora_rank``)        ``self_attention.linear_q_proj.weight``
``self_attn.kv_a_proj_with_mqa.weight``                 ``self_attention.linear_kv_down_proj.weight``
``self_attn.kv_a_layernorm.weight``                     ``self_attention.kv_layernorm.weight``
``self_attn.kv_b_proj.weight``                          ``self_attention.linear_kv_up_proj.weight``
``self_attn.o_proj.weight``                             ``self_attention.linear_proj.weight``
``post_attention_layernorm.weight``                     ``pre_mlp_layernorm.weight``
``mlp.{gate,up}_proj.weight`` (dense)                   ``mlp.linear_fc1.weight`` ([gate; up])
``mlp.down_proj.weight`` (dense)                        ``mlp.linear_fc2.weight``
``mlp.gate.weight`` (MoE)                               ``mlp.router.weight``
``mlp.gate.e_score_correction_bias``                    ``mlp.router.expert_bias`` (a buffer)
``mlp.experts.gate_up_proj[e]``                         ``mlp.experts.local_experts.e.linear_fc1.weight``
``mlp.experts.down_proj[e]``                            ``mlp.experts.local_experts.e.linear_fc2.weight``
``mlp.shared_experts.{gate,up}_proj.weight``            ``mlp.shared_experts.linear_fc1.weight``
``mlp.shared_experts.down_proj.weight``                 ``mlp.shared_experts.linear_fc2.weight``
``self_attn.indexer.wq_b.weight`` (DSA)                 ``self_attention.core_attention.indexer.linear_wq_b.weight``
``self_attn.indexer.wk.weight``                         ``...indexer.linear_wk.weight``
``self_attn.indexer.k_norm.{weight,bias}``              ``...indexer.k_norm.{weight,bias}``
``self_attn.indexer.weights_proj.weight``               ``...indexer.linear_weights_proj.weight``
``model.norm.weight``                                   ``decoder.final_layernorm.weight``
``lm_head.weight``                                      ``output_layer.weight``
======================================================  ==============================================

The per-head layouts agree as they are: ``q_b_proj`` rows are [nope; rope] per head, as
megatron splits ``linear_q_up_proj``; ``kv_b_proj`` rows are [k nope; v] per head;
``kv_a_proj_with_mqa`` rows are [latent; shared rotary key]; the rotary columns stay interleaved
(megatron's MLA de-interleaves them in its RoPE, as transformers' ``rope_interleave``). The
indexer's per-head columns are reordered (``wq_b`` rows per head, ``wk`` rows, ``k_norm``) by
:func:`replayrl.trainer.backends.megatron_dsa.indexer_column_order`: transformers' rotary columns
come first, megatron's last and interleaved. Rank sharding is
:mod:`replayrl.trainer.backends.megatron_weights`'s (by ``partition_dim``).
"""
from __future__ import annotations

import numpy as np
import torch

from replayrl.trainer.errors import WeightMapError

__all__ = ["mla_hf_to_megatron", "mla_megatron_to_hf"]


def _need(state: dict, name: str) -> torch.Tensor:
    if name not in state:
        raise WeightMapError(f"weight {name!r} missing")
    return torch.as_tensor(state[name])


def _indexer(config) -> list[tuple[str, str, int]]:
    """``(hf, megatron, heads)`` of the indexer weights whose rows are per-head indexer columns
    (``heads`` blocks of ``index_head_dim`` rows, reordered by ``indexer_column_order``)."""
    heads = int(config.hf_config().index_n_heads)
    out = []
    for i in config.indexed_layers:
        hf, mg = f"model.layers.{i}.self_attn.indexer.", f"decoder.layers.{i}.self_attention.core_attention.indexer."
        out += [(hf + "wq_b.weight", mg + "linear_wq_b.weight", heads),
                (hf + "wk.weight", mg + "linear_wk.weight", 1),
                (hf + "k_norm.weight", mg + "k_norm.weight", 1),
                (hf + "k_norm.bias", mg + "k_norm.bias", 1)]
    return out


def _reorder(t: torch.Tensor, heads: int, order: torch.Tensor) -> torch.Tensor:
    """Rows of ``t`` (``heads * len(order)`` of them) reordered within each head by ``order``."""
    d = len(order)
    return t.reshape(heads, d, *t.shape[1:])[:, order].reshape(t.shape)


def _table(config) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]],
                            list[tuple[str, str, str]]]:
    """``(renamed, fc1, experts)``: ``(hf, megatron)`` pairs that only change name;
    ``(megatron, hf gate, hf up)`` stacked along dim 0; ``(megatron prefix, hf gate_up, hf
    down)`` of each MoE layer's fused expert tensors."""
    from replayrl.trainer.backends.megatron_mla import mla_shape

    s = mla_shape(config)
    renamed = [("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
               ("model.norm.weight", "decoder.final_layernorm.weight"),
               ("lm_head.weight", "output_layer.weight")]
    fc1, experts = [], []
    for i in range(s["num_hidden_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        a, ma = hf + "self_attn.", mg + "self_attention."
        renamed += [(hf + "input_layernorm.weight", mg + "input_layernorm.weight"),
                    (hf + "post_attention_layernorm.weight", mg + "pre_mlp_layernorm.weight"),
                    (a + "kv_a_proj_with_mqa.weight", ma + "linear_kv_down_proj.weight"),
                    (a + "kv_a_layernorm.weight", ma + "kv_layernorm.weight"),
                    (a + "kv_b_proj.weight", ma + "linear_kv_up_proj.weight"),
                    (a + "o_proj.weight", ma + "linear_proj.weight")]
        if s["q_lora_rank"]:
            renamed += [(a + "q_a_proj.weight", ma + "linear_q_down_proj.weight"),
                        (a + "q_a_layernorm.weight", ma + "q_layernorm.weight"),
                        (a + "q_b_proj.weight", ma + "linear_q_up_proj.weight")]
        else:
            renamed.append((a + "q_proj.weight", ma + "linear_q_proj.weight"))
        if i in config.indexed_layers:  # the rest of the indexer: _indexer
            renamed.append((a + "indexer.weights_proj.weight",
                            ma + "core_attention.indexer.linear_weights_proj.weight"))
        if i in s["moe_layers"]:
            renamed += [(hf + "mlp.gate.weight", mg + "mlp.router.weight"),
                        (hf + "mlp.gate.e_score_correction_bias", mg + "mlp.router.expert_bias")]
            experts.append((mg + "mlp.experts.local_experts.", hf + "mlp.experts.gate_up_proj",
                            hf + "mlp.experts.down_proj"))
            if s["n_shared_experts"]:
                sh, msh = hf + "mlp.shared_experts.", mg + "mlp.shared_experts."
                fc1.append((msh + "linear_fc1.weight", sh + "gate_proj.weight", sh + "up_proj.weight"))
                renamed.append((sh + "down_proj.weight", msh + "linear_fc2.weight"))
        else:
            fc1.append((mg + "mlp.linear_fc1.weight", hf + "mlp.gate_proj.weight",
                        hf + "mlp.up_proj.weight"))
            renamed.append((hf + "mlp.down_proj.weight", mg + "mlp.linear_fc2.weight"))
    return renamed, fc1, experts


def mla_hf_to_megatron(state: dict, config) -> dict[str, torch.Tensor]:
    """Unsharded megatron-named tensors (global layer and expert ids) from HF-named weights.

    Args:
        state: HF name -> tensor / numpy array, the whole policy (transformers' names).
        config: its ``FamilyConfig`` (a :data:`replayrl.trainer.backends.megatron_mla.MEGATRON_FAMILIES` type).

    Raises:
        WeightMapError: a missing HF weight (named).
    """
    renamed, fc1, experts = _table(config)
    out = {mg: _need(state, hf) for hf, mg in renamed}
    if config.indexed_layers:
        from replayrl.trainer.backends.megatron_dsa import indexer_column_order

        order = indexer_column_order(config)
        for hf, mg, heads in _indexer(config):
            out[mg] = _reorder(_need(state, hf), heads, order)
    for mg, gate, up in fc1:
        out[mg] = torch.cat([_need(state, gate), _need(state, up)])
    for prefix, gate_up, down in experts:
        for e, (w1, w2) in enumerate(zip(_need(state, gate_up), _need(state, down))):
            out[f"{prefix}{e}.linear_fc1.weight"] = w1
            out[f"{prefix}{e}.linear_fc2.weight"] = w2
    return out


def mla_megatron_to_hf(full: dict, config) -> dict[str, np.ndarray]:
    """Inverse of :func:`mla_hf_to_megatron`: HF-named read-only float32 arrays.

    Raises:
        WeightMapError: a missing megatron tensor (named).
    """
    from replayrl.trainer.backends.megatron_mla import mla_shape

    n_experts = mla_shape(config)["n_routed_experts"]
    renamed, fc1, experts = _table(config)
    out = {hf: _need(full, mg) for hf, mg in renamed}
    if config.indexed_layers:
        from replayrl.trainer.backends.megatron_dsa import indexer_column_order

        back = torch.argsort(indexer_column_order(config))
        for hf, mg, heads in _indexer(config):
            out[hf] = _reorder(_need(full, mg), heads, back)
    for mg, gate, up in fc1:
        out[gate], out[up] = _need(full, mg).chunk(2)
    for prefix, gate_up, down in experts:
        out[gate_up] = torch.stack([_need(full, f"{prefix}{e}.linear_fc1.weight")
                                    for e in range(n_experts)])
        out[down] = torch.stack([_need(full, f"{prefix}{e}.linear_fc2.weight")
                                 for e in range(n_experts)])
    arrays = {}
    for k, v in out.items():
        a = np.ascontiguousarray(v.detach().float().numpy())
        a.flags.writeable = False
        arrays[k] = a
    return arrays
