"""The embedded policy as a megatron-core ``GPTModel``: parallel setup, config mapping, build.

:func:`transformer_config` maps a :class:`replayrl.rollout.model.config.ModelConfig` (Hugging Face
``Qwen3MoeConfig`` names) onto megatron-core's ``TransformerConfig`` so that the GPTModel built
with the local (non-TransformerEngine) layer specs computes the same function as
:class:`replayrl.rollout.model.qwen3_moe.Qwen3MoeForCausalLM` (docs/design/megatron.md#megatron-backend):

* RMSNorm everywhere, RMSNorm on q and k over ``head_dim`` before RoPE (``qk_layernorm``);
* rotate-half RoPE with base ``rope_theta``; GQA with ``num_key_value_heads`` query groups;
* SiLU-gated MLPs (``gated_linear_unit``, fc1 = [gate; up]) without biases; dense layers of
  width ``intermediate_size`` where ``ModelConfig.moe_layers`` has no entry
  (``moe_layer_freq`` as a 0/1 list), MoE layers of ``num_experts`` experts of width
  ``moe_intermediate_size``;
* softmax top-k routing: with ``norm_topk_prob`` the softmax over the k selected logits
  (megatron's default, equal to renormalised top-k probabilities), else pre-softmax top-k;
* no dropout, no auxiliary loss, no capacity limit (every token reaches its k experts);
* untied embedding and LM head.

The DSA-style indexer of ``ModelConfig.indexed_layers`` is the embedded model's own, placed in
front of megatron's self-attention on those layers
(:mod:`replayrl.trainer.backends.megatron_indexer`): megatron-core's DSA attention is built for
multi-latent attention only (it serves the MLA families,
:mod:`replayrl.trainer.backends.megatron_dsa`). Under context parallelism every layer's core
attention is :mod:`replayrl.trainer.backends.megatron_context_parallel`'s (megatron-core's local
attention refuses ``context_parallel_size > 1``).
"""
from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.distributed as dist

from replayrl.rollout.model.config import ModelConfig
from replayrl.trainer.errors import MegatronModelError

__all__ = [ "MegatronParallel", "build_gpt_model", "init_parallel", "layout_errors",
           "transformer_config"]


@dataclasses.dataclass(frozen=True)
class MegatronParallel:
    """The parallel layout of the megatron trainer ranks.

    Attributes:
        tp: tensor-parallel size (sequence parallelism is on whenever ``tp > 1``: megatron-core
            requires it for MoE layers under TP).
        ep: expert-parallel size.
        pp: pipeline-parallel size (stages hold contiguous, equal layer ranges).
        cp: context-parallel size (each rank holds 2 of ``2 * cp`` chunks of every row;
            :mod:`replayrl.trainer.backends.megatron_context_parallel`).

    The data-parallel size is what remains of the world: ``world / (tp * pp * cp)``.
    """

    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "pp", "cp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MegatronModelError(f"MegatronParallel.{name} must be an int >= 1, got {v!r}")

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism: on with tensor parallelism."""
        return self.tp > 1


def init_parallel(parallel: MegatronParallel, seed: int, *, own_world: bool = False) -> None:
    """Initialise torch.distributed (gloo) and megatron's parallel groups and RNG states.

    With ``own_world`` (the one-rank TrainerActor, also when it is one rank of a
    ``replayrl.tools.run.torchrun_entry`` actor world whose other ranks never join a process group), or
    without torchrun's environment, the process gets a one-rank gloo group with an in-process
    store; otherwise it joins torchrun's world (``env://``: every rank is a megatron rank).
    Applies :mod:`replayrl.trainer.backends.megatron_cpu_compat` first (the backend trains on
    the CPU, also on a machine with CUDA under ``--device cpu``).

    Raises:
        MegatronModelError: the world size is not a multiple of ``tp * pp * cp``, or ``ep``
            does not divide ``world / pp``.
    """
    from replayrl.trainer.backends import megatron_cpu_compat

    megatron_cpu_compat.enable()
    if not dist.is_initialized():
        if not own_world and "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group("gloo")
        else:
            # an in-process store: a tcp:// or env:// rendezvous under torchrun would go through
            # the elastic agent's store and wait for the actor world's other ranks
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    p = parallel
    # expert layers: expert TP (= tp) x ep x expert DP ranks in every pipeline stage
    if world % (p.tp * p.pp * p.cp) or (world // (p.pp * p.tp)) % p.ep:
        raise MegatronModelError(f"world size {world} does not fit tp={p.tp} x pp={p.pp} "
                                 f"x cp={p.cp} (x ep={p.ep} over the ranks of one TP slice of "
                                 f"a stage)")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(p.tp, p.pp, context_parallel_size=p.cp,
                                 expert_model_parallel_size=p.ep)
    model_parallel_cuda_manual_seed(int(seed))


def layout_errors(config: ModelConfig, parallel: MegatronParallel) -> list[str]:
    """What keeps ``config`` from splitting over ``parallel``, one sentence each (empty: fits).

    megatron-core divides the vocabulary, the attention heads, the query groups and the MLP
    widths over the tensor-parallel ranks (the experts' width over the expert tensor-parallel
    ranks, which megatron sets to ``tp``), the experts over the expert-parallel ranks and the
    layers over the pipeline stages; a size that does not divide fails deep inside its
    constructors. Pure arithmetic (no megatron import), so the run's configuration check can
    refuse a layout before any process starts (docs/design/megatron.md#megatron-backend).

    Args:
        config: the policy's architecture.
        parallel: the layout (``tp``, ``ep``, ``pp``).

    Returns:
        e.g. ``["ModelConfig.vocab_size=44 is not a multiple of --tp-size 3"]``; for a family
        room policy (``FamilyConfig``) also the fields the MLA mapping does not compute
        (:mod:`replayrl.trainer.backends.megatron_mla`).
    """
    if not isinstance(config, ModelConfig):  # a family room policy: its own shape
        from replayrl.trainer.backends.megatron_mla import family_layout_errors, unsupported_fields

        return unsupported_fields(config) or family_layout_errors(config, parallel)
    p = parallel
    checks = [("vocab_size", config.vocab_size, p.tp, "--tp-size"),
              ("num_attention_heads", config.num_attention_heads, p.tp, "--tp-size"),
              ("num_key_value_heads", config.num_key_value_heads, p.tp, "--tp-size"),
              ("num_hidden_layers", config.num_hidden_layers, p.pp, "--pp-size")]
    if len(config.moe_layers) < config.num_hidden_layers:  # dense MLP layers
        checks.append(("intermediate_size", config.intermediate_size, p.tp, "--tp-size"))
    if config.moe_layers:
        checks += [("num_experts", config.num_experts, p.ep, "--ep-size"),
                   ("moe_intermediate_size", config.moe_intermediate_size, p.tp, "--tp-size")]
    return [f"ModelConfig.{name}={value} is not a multiple of {flag} {size}"
            for name, value, size, flag in checks if value % size]


def transformer_config(config: ModelConfig, parallel: MegatronParallel):
    """megatron-core ``TransformerConfig`` of ``config`` under ``parallel`` (fp32, CPU init).

    Raises:
        MegatronModelError: a size does not divide over the ranks (vocabulary, query groups and
        experts must be multiples of tp / tp /
            ep; layers of pp).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    p = parallel
    problems = layout_errors(config, p)
    if problems:
        raise MegatronModelError(f"{problems[0]} (parallel layout {p})")
    moe = bool(config.moe_layers)
    extra = {}
    if moe:
        extra = dict(
            num_moe_experts=config.num_experts, moe_router_topk=config.num_experts_per_tok,
            moe_ffn_hidden_size=config.moe_intermediate_size,
            moe_layer_freq=[int(i in config.moe_layers) for i in range(config.num_hidden_layers)],
            moe_router_pre_softmax=not config.norm_topk_prob,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall", moe_enable_routing_replay=True,
            moe_router_dtype="fp32", moe_grouped_gemm=False)
    return TransformerConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads, kv_channels=config.head_dim,
        ffn_hidden_size=config.intermediate_size, normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps, qk_layernorm=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        bf16=False, fp16=False, tensor_model_parallel_size=p.tp,
        sequence_parallel=p.sequence_parallel, expert_model_parallel_size=p.ep,
        pipeline_model_parallel_size=p.pp, pipeline_dtype=torch.float32,
        context_parallel_size=p.cp,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        # pipeline p2p: the device synchronize after batched send / recv works around an old
        # CUDA PyTorch race; without CUDA there is nothing to synchronize (docs/design/megatron.md#pipeline-parallel)
        batch_p2p_sync=torch.cuda.is_available(),
        **extra)


def build_gpt_model(config: ModelConfig, parallel: MegatronParallel):
    """This rank's part of the policy as a megatron-core ``GPTModel`` (local layer specs).

    Call after :func:`init_parallel`. The weights are megatron's random init; load real ones
    with :func:`replayrl.trainer.backends.megatron_weights.load_hf_weights`. A family room
    policy (``FamilyConfig``) is built by
    :func:`replayrl.trainer.backends.megatron_mla.build_mla_gpt_model`.

    Returns:
        ``(model, transformer_config, indexer)``: ``indexer`` is the
        :class:`replayrl.trainer.backends.megatron_indexer.IndexerReplay` of this stage's indexed layers,
        or None when the indexer is off.

    Raises:
        MegatronModelError: as :func:`transformer_config`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    if not isinstance(config, ModelConfig):  # DeepSeek-V3 / GLM-4.7-Flash: megatron's MLA
        from replayrl.trainer.backends.megatron_mla import build_mla_gpt_model

        return build_mla_gpt_model(config, parallel)
    tcfg = transformer_config(config, parallel)
    spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm")
    indexer = None
    if config.indexed_layers:
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from replayrl.trainer.backends.megatron_indexer import IndexerReplay, indexed_attention_class

        offset = get_transformer_layer_offset(tcfg)
        local = [offset + j for j in range(len(spec.layer_specs))]
        indexer = IndexerReplay(config, local)
        attention = indexed_attention_class(config, indexer)
        for j, layer in enumerate(local):
            if layer in config.indexed_layers:  # layer specs are shared objects: copy, then swap
                spec.layer_specs[j] = copy.deepcopy(spec.layer_specs[j])
                spec.layer_specs[j].submodules.self_attention.module = attention
    if parallel.cp > 1:  # megatron's local attention has no CP (docs/design/megatron.md#context-parallel)
        from replayrl.trainer.backends.megatron_context_parallel import context_parallel_attention_class

        core = context_parallel_attention_class()
        for j, layer_spec in enumerate(spec.layer_specs):
            spec.layer_specs[j] = copy.deepcopy(layer_spec)
            spec.layer_specs[j].submodules.self_attention.submodules.core_attention = core
    model = GPTModel(tcfg, spec, vocab_size=config.vocab_size,
                     max_sequence_length=config.max_position_embeddings,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=int(config.rope_theta) if float(config.rope_theta).is_integer()
                     else config.rope_theta)
    return model, tcfg, indexer
