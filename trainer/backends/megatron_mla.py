"""The MLA families (DeepSeek-V3, GLM-4.7-Flash, DeepSeek-V3.2, GLM-5) as a megatron-core
``GPTModel``: config mapping, build.

The families ``deepseek_v3`` and ``glm4_moe_lite`` of the family room (transformers'
``DeepseekV3ForCausalLM`` / ``Glm4MoeLiteForCausalLM``, rollout/model/families/) have the same
architecture and the same weight names; ``deepseek_v32`` / ``glm_moe_dsa`` (``DeepseekV32`` /
``GlmMoeDsa``) add the DSA lightning indexer, built from megatron-core's ``DSAttention`` /
``DSAIndexer`` with replay (:mod:`replayrl.trainer.backends.megatron_dsa`).
:func:`mla_transformer_config` maps their config onto
megatron-core's ``MLATransformerConfig`` so that the GPTModel built from megatron-core's own local
(non-TransformerEngine) layer spec computes transformers' function
(docs/design/megatron.md#megatron-families):

* multi-latent attention (``MLASelfAttention``): q down / RMSNorm / up projection (or one q
  projection without ``q_lora_rank``), the joint kv down projection with the shared rotary key,
  kv RMSNorm and up projection; softmax scale ``(qk_nope + qk_rope) ** -0.5``;
* RoPE on the ``qk_rope_head_dim`` columns, pairs interleaved (transformers' ``rope_interleave``:
  megatron de-interleaves every MLA rotary input the same way), base ``rope_theta``;
* MoE layers (``mlp_layer_types`` / ``first_k_dense_replace``; the others dense SwiGLU MLPs of
  width ``intermediate_size``): sigmoid scores, the expert bias (transformers'
  ``e_score_correction_bias``, frozen: update rate 0) added for the choice only, group-limited
  top-k (``n_group`` / ``topk_group``), the chosen scores renormalised and scaled by
  ``routed_scaling_factor``; ``n_shared_experts * moe_intermediate_size`` shared experts, no gate;
* RMSNorm everywhere, no biases, no dropout, no auxiliary loss, no capacity limit, untied head;
* DSA families: every layer's core attention is megatron's sparse ``DSAttention`` (the indexer
  frozen, as transformers keeps it); GLM-5's "shared" layers attend the previous indexed layer's
  keys.

What megatron-core computes differently is refused (:func:`unsupported_fields`), never
approximated: YaRN RoPE (megatron has it, untested here), non-interleaved rotary columns,
unnormalised top-k weights (megatron always renormalises sigmoid top-k), a group score other than
the sum of each group's top 2 (megatron sums the top ``topk / topk_group``), attention biases,
another activation than SiLU, a tied LM head.
"""
from __future__ import annotations

import copy

import torch

from replayrl.trainer.backends.megatron_families import MEGATRON_FAMILIES
from replayrl.trainer.errors import MegatronModelError

__all__ = ["MEGATRON_FAMILIES", "LATENT_NORM_EPS", "family_layout_errors", "latent_attention_class", "mla_shape",
           "mla_transformer_config", "build_mla_gpt_model", "unsupported_fields"]


LATENT_NORM_EPS = 1e-6
"""transformers builds ``q_a_layernorm`` / ``kv_a_layernorm`` with its RMSNorm class's default
epsilon, not ``rms_norm_eps``; megatron's MLA builds them with ``layernorm_epsilon``, so the
built model's two latent norms are set to this value."""


def mla_shape(config) -> dict:
    """The numbers of a family config that the mapping reads (transformers' defaults applied).

    Args:
        config: a :class:`replayrl.rollout.model.families.base.FamilyConfig` of a
            :data:`MEGATRON_FAMILIES` type.

    Returns:
        a dict of ints / floats / strs / bools under transformers' field names, plus
        ``moe_layers`` (tuple of global layer ids) and ``rope_type``.
    """
    hf = config.hf_config()
    fields = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
              "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
              "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
              "norm_topk_prob", "routed_scaling_factor", "rms_norm_eps", "hidden_act",
              "attention_bias", "rope_interleave", "max_position_embeddings",
              "tie_word_embeddings")
    shape = {name: getattr(hf, name, None) for name in fields}
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    shape["rope_type"] = rope.get("rope_type", "default")
    shape["rope_theta"] = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    shape["moe_layers"] = tuple(config.moe_layers)
    shape["dsa"] = bool(config.indexed_layers)
    if shape["dsa"]:  # transformers' DSA classes always interleave the MLA rotary columns
        shape["rope_interleave"] = getattr(hf, "rope_interleave", True)
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            shape[name] = int(getattr(hf, name))
    return shape


def unsupported_fields(config) -> list[str]:
    """What of a family config the megatron mapping does not compute as transformers does, one
    sentence each naming the config.json field (empty: supported).

    Args:
        config: a family room ``FamilyConfig``.
    """
    if config.family not in MEGATRON_FAMILIES:
        return [f"model_type {config.family!r} is not one of {', '.join(MEGATRON_FAMILIES)}"]
    s = mla_shape(config)
    out = []
    if s["rope_type"] != "default":
        out.append(f"rope_parameters.rope_type {s['rope_type']!r} (only the default RoPE is mapped)")
    if not s["rope_interleave"]:
        out.append("rope_interleave false (megatron's MLA de-interleaves the rotary columns)")
    if s["num_experts_per_tok"] > 1 and not s["norm_topk_prob"]:
        out.append("norm_topk_prob false (megatron renormalises the sigmoid top-k weights)")
    if s["n_group"] and s["topk_group"] and s["topk_group"] < s["n_group"] \
            and s["num_experts_per_tok"] // s["topk_group"] != 2:
        out.append(f"num_experts_per_tok / topk_group = {s['num_experts_per_tok']} / "
                   f"{s['topk_group']} != 2 (transformers scores a group by its top 2 experts, "
                   f"megatron by its top num_experts_per_tok / topk_group)")
    if s["attention_bias"]:
        out.append("attention_bias true (megatron's MLA projections have no bias)")
    if s["hidden_act"] != "silu":
        out.append(f"hidden_act {s['hidden_act']!r} (only silu is mapped)")
    if s["tie_word_embeddings"]:
        out.append("tie_word_embeddings true (the mapping keeps the LM head untied)")
    if s["dsa"] and not s["q_lora_rank"]:
        out.append("q_lora_rank null (the DSA indexer reads the compressed query)")
    if s["dsa"] and not s["qk_rope_head_dim"] < s["index_head_dim"]:
        out.append(f"index_head_dim {s['index_head_dim']} <= qk_rope_head_dim "
                   f"{s['qk_rope_head_dim']} (megatron's indexer rotates the last "
                   f"qk_rope_head_dim of more columns)")
    return out


def family_layout_errors(config, parallel) -> list[str]:
    """What keeps a family config from splitting over ``parallel``, one sentence each.

    megatron-core divides the vocabulary, the attention heads and the MLP widths over the
    tensor-parallel ranks (the latent down projections are replicated), the experts over the
    expert-parallel ranks, the layers over the pipeline stages.

    Args:
        config: a family room ``FamilyConfig`` of a :data:`MEGATRON_FAMILIES` type.
        parallel: a :class:`replayrl.trainer.backends.megatron_model.MegatronParallel`.

    Returns:
        e.g. ``["config.json n_routed_experts=8 is not a multiple of --ep-size 3"]``.
    """
    s, p = mla_shape(config), parallel
    out = []
    if p.cp > 1 and s["dsa"]:
        out.append(f"--cp-size {p.cp}: context parallelism is not offered for the "
                   f"{config.family!r} family (megatron-core's DSAttention has none)")
    if p.pp > 1 and s["dsa"] and not s["num_hidden_layers"] % p.pp:
        per_stage = s["num_hidden_layers"] // p.pp
        first = [i for i in range(per_stage, s["num_hidden_layers"], per_stage)
                 if i not in config.indexed_layers]
        if first:  # a "shared" layer reads the keys of an indexed layer on an earlier stage
            out.append(f"--pp-size {p.pp}: layer {first[0]} starts a pipeline stage but has no "
                       f"indexer (config.json indexer_types 'shared'): it reuses the previous "
                       f"stage's top-k")
    checks = [("vocab_size", s["vocab_size"], p.tp, "--tp-size"),
              ("num_attention_heads", s["num_attention_heads"], p.tp, "--tp-size"),
              ("num_hidden_layers", s["num_hidden_layers"], p.pp, "--pp-size")]
    if len(s["moe_layers"]) < s["num_hidden_layers"]:
        checks.append(("intermediate_size", s["intermediate_size"], p.tp, "--tp-size"))
    if s["moe_layers"]:
        checks += [("n_routed_experts", s["n_routed_experts"], p.ep, "--ep-size"),
                   ("moe_intermediate_size", s["moe_intermediate_size"], p.tp, "--tp-size")]
    out += [f"config.json {name}={value} is not a multiple of {flag} {size}"
            for name, value, size, flag in checks if value % size]
    return out


def mla_transformer_config(config, parallel):
    """megatron-core ``MLATransformerConfig`` of a family config under ``parallel`` (fp32, CPU
    init).

    Raises:
        MegatronModelError: an unsupported field (:func:`unsupported_fields`) or a layout that
            does not divide (:func:`family_layout_errors`), the first one named.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    problems = unsupported_fields(config) or family_layout_errors(config, parallel)
    if problems:
        raise MegatronModelError(f"--train-backend megatron, {config.family!r}: {problems[0]}")
    s, p = mla_shape(config), parallel
    moe = bool(s["moe_layers"])
    extra = {}
    if moe:
        grouped = bool(s["n_group"] and s["topk_group"] and s["topk_group"] < s["n_group"])
        extra = dict(
            num_moe_experts=s["n_routed_experts"], moe_router_topk=s["num_experts_per_tok"],
            moe_ffn_hidden_size=s["moe_intermediate_size"],
            moe_layer_freq=[int(i in s["moe_layers"]) for i in range(s["num_hidden_layers"])],
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,  # transformers' correction bias is not trained
            moe_router_num_groups=s["n_group"] if grouped else None,
            moe_router_group_topk=s["topk_group"] if grouped else None,
            moe_router_topk_scaling_factor=float(s["routed_scaling_factor"]),
            moe_shared_expert_intermediate_size=(s["moe_intermediate_size"] * s["n_shared_experts"]
                                                 if s["n_shared_experts"] else None),
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall", moe_enable_routing_replay=True,
            moe_router_dtype="fp32", moe_grouped_gemm=False)
    if s["dsa"]:  # the indexer loss stays off: the indexer is frozen, as transformers keeps it
        extra.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=s["index_n_heads"],
                     dsa_indexer_head_dim=s["index_head_dim"], dsa_indexer_topk=s["index_topk"],
                     dsa_indexer_loss_coeff=0.0)
    theta = s["rope_theta"]
    return MLATransformerConfig(
        num_layers=s["num_hidden_layers"], hidden_size=s["hidden_size"],
        num_attention_heads=s["num_attention_heads"], ffn_hidden_size=s["intermediate_size"],
        q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"],
        qk_head_dim=s["qk_nope_head_dim"], qk_pos_emb_head_dim=s["qk_rope_head_dim"],
        v_head_dim=s["v_head_dim"], rope_type="rope", rotary_base=theta,
        rotary_scaling_factor=1.0, normalization="RMSNorm", layernorm_epsilon=s["rms_norm_eps"],
        qk_layernorm=True,  # the q / kv latent RMSNorms
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, bf16=False, fp16=False, tensor_model_parallel_size=p.tp,
        sequence_parallel=p.sequence_parallel, expert_model_parallel_size=p.ep,
        pipeline_model_parallel_size=p.pp, pipeline_dtype=torch.float32,
        context_parallel_size=p.cp, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        batch_p2p_sync=torch.cuda.is_available(), **extra)


def latent_attention_class():
    """megatron-core's local ``DotProductAttention`` for MLA: megatron-core 0.16.1's local layer
    spec puts ``DotProductAttention`` in ``MLASelfAttention``, which builds it with
    ``k_channels`` / ``v_channels`` (query-key heads of ``qk_nope + qk_rope``, value heads of
    ``v_head_dim``) that only TransformerEngine's attention accepts. This subclass takes them:
    the scores, mask, softmax and value product are megatron's, the context width per rank is
    ``heads / tp * v_head_dim``. Built lazily (megatron is imported with the backend)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class LatentDotProductAttention(DotProductAttention):
        """``DotProductAttention`` with MLA's key and value head widths (see
        :func:`latent_attention_class`)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     pg_collection=None, *, k_channels=None, v_channels=None):
            super().__init__(config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            if v_channels is None:  # megatron's base Attention builds one first, then MLA's
                return
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads,
                                                    self.pg_collection.tp.size())

    return LatentDotProductAttention


def _mla_without_transformer_engine() -> None:
    """megatron-core 0.16.1's MLA module sets ``HAVE_TE`` when its TransformerEngine extension
    imports, and that extension imports without TransformerEngine, leaving ``TELinear`` a
    ``MagicMock`` placeholder: ``MLASelfAttention.__init__`` then fails on ``isinstance(...,
    TELinear)``. Without TransformerEngine installed the flag is set false (idempotent)."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def build_mla_gpt_model(config, parallel):
    """This rank's part of a family policy as a megatron-core ``GPTModel`` (local layer specs,
    ``multi_latent_attention``). Call after
    :func:`replayrl.trainer.backends.megatron_model.init_parallel`; load the weights with
    :func:`replayrl.trainer.backends.megatron_weights.load_hf_weights`.

    Returns:
        ``(model, transformer_config, indexer)``: ``indexer`` is the
        :class:`replayrl.trainer.backends.megatron_dsa.DSAReplay` of this stage's layers (DSA
        families), else None.

    Raises:
        MegatronModelError: as :func:`mla_transformer_config`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    _mla_without_transformer_engine()
    tcfg = mla_transformer_config(config, parallel)
    spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm")
    spec = copy.deepcopy(spec)  # megatron's specs are shared objects
    core = latent_attention_class()
    if parallel.cp > 1:  # the keys and values after MLA's up projections, gathered over CP
        from replayrl.trainer.backends.megatron_context_parallel import context_parallel_attention_class

        core = context_parallel_attention_class(core)
    cores = [core] * len(spec.layer_specs)
    indexer = None
    if config.indexed_layers:  # megatron's DSAttention, replayed (megatron_dsa)
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from replayrl.trainer.backends.megatron_dsa import DSAReplay, dsa_core_attention_specs

        offset = get_transformer_layer_offset(tcfg)
        local = [offset + j for j in range(len(spec.layer_specs))]
        indexer = DSAReplay(config, local)
        cores = dsa_core_attention_specs(config, indexer, local)
        # layers of one kind share a spec object: one copy each, as their cores differ
        spec.layer_specs = [copy.deepcopy(layer_spec) for layer_spec in spec.layer_specs]
    from megatron.core.post_training.modelopt.layers import Linear

    for layer_spec, core_attention in zip(spec.layer_specs, cores):
        attention = layer_spec.submodules.self_attention.submodules
        attention.core_attention = core_attention
        # replicated down projections (megatron's own local Linear, its weights marked
        # sequence_parallel): the local spec's column-parallel ones gather the shared rotary
        # key over TP with an all-gather whose backward keeps only this rank's columns, so the
        # other ranks' heads' gradient of that key was dropped (measured: TP=2 gradients 7 %
        # off transformers'); replicated, the key is gathered over the sequence and its
        # gradient reduce-scattered, as megatron does with TransformerEngine's duplicated linear
        attention.linear_q_down_proj = Linear
        attention.linear_kv_down_proj = Linear
    s = mla_shape(config)
    model = GPTModel(tcfg, spec, vocab_size=s["vocab_size"],
                     max_sequence_length=s["max_position_embeddings"],
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="none")
    for layer in model.decoder.layers:
        attention = layer.self_attention
        for norm in (getattr(attention, "q_layernorm", None), attention.kv_layernorm):
            if norm is not None:
                norm.eps = LATENT_NORM_EPS
    if indexer is not None:  # frozen, as transformers keeps it (its top-k has no gradient)
        for name, p in model.named_parameters():
            if ".indexer." in name:
                p.requires_grad_(False)
    return model, tcfg, indexer
