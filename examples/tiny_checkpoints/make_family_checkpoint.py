"""Write a tiny random checkpoint of a model type ``--hf-checkpoint`` reads, to train on a CPU.

    python examples/tiny_checkpoints/make_family_checkpoint.py --family deepseek_v4 --out /tmp/tiny_v4
    replayrl train --hf-checkpoint /tmp/tiny_v4 --num-steps 20

``--family`` is any ``model_type`` of :data:`TINY_TYPES`: the embedded model's ``qwen3`` /
``qwen3_moe`` and every family of the family room (DeepSeek-V3, -V3.2, -V4, Kimi K2.5, GLM-5,
GLM-4.7-Flash, gpt-oss, Qwen3.5-MoE). The model is transformers' own (``AutoConfig.for_model`` +
``from_config``, random weights from ``--seed``, written by ``save_pretrained`` in shards);
nothing is downloaded. The tests build their checkpoints with this module's :func:`tiny_config`
and :func:`tiny_checkpoint` (tests/family_checkpoints.py loads it), so the shapes a reader trains
are the ones the tests check. The shapes (float32, vocabulary 97, 256 positions): hidden 64, 3-4
layers, 8 routed experts top-2;

* ``deepseek_v32`` / ``glm_moe_dsa``: MLA, the first layer dense, the DSA indexer keeping 4
  keys; ``glm4_moe_lite``: the same without an indexer; ``gpt_oss``: sinks, a sliding window of
  8 on its sliding layers;
* ``deepseek_v4``: one layer of each attention type (sliding window 8, CSA 4:1 with
  ``index_topk`` 2, HCA 8:1) and a second CSA layer, the first layer hash-routed;
* ``deepseek_v3``; ``kimi_k25``: a ``deepseek_v3`` text tower under a one-layer vision tower;
* ``qwen3_5_moe_text``: three gated DeltaNet layers and a full-attention one; ``qwen3_5_moe``:
  that text model under a one-layer vision tower;
* ``qwen3`` (dense) and ``qwen3_moe`` (every layer MoE): 2 layers, 4 heads of 16, 2 KV heads.

Weights other than norms (and a few named parameters) are multiplied by a scale so top-k
choices are not near ties.

Beside it goes the embedded model's word-level tokenizer (``tokenizer.json``: the built-in
task's 44 words), which ``--save-hf`` copies, and a ``generation_config.json`` whose
``eos_token_id`` is that tokenizer's ``<eos>`` (transformers' own names the config's, another
word of it); with your own ``--prompt-data`` bring your ``--tokenizer`` (docs/own-data.md).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=97, max_position_embeddings=256)
_MLA = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_DSA = dict(index_topk=4, index_n_heads=2, index_head_dim=16)

DSA_TYPES = ("deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "gpt_oss")
"""The types of the first family-room shapes (MLA or gpt-oss on :data:`_BASE`), scaled by 5."""

# every layer type: sliding window, CSA (4:1, the indexer keeps 2 entries), HCA (8:1 here, 128 in
# the released models) and another CSA; the first layer hash-routed, the others top-2 of 8
TINY_V4 = dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32,
               vocab_size=97, max_position_embeddings=256, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1,
               layer_types=["sliding_attention", "compressed_sparse_attention",
                            "heavily_compressed_attention", "compressed_sparse_attention"],
               mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
               hc_mult=2, hc_sinkhorn_iters=5, sliding_window=8, o_groups=2, o_lora_rank=16,
               index_n_heads=2, index_head_dim=16, index_topk=2, num_nextn_predict_layers=0,
               bos_token_id=0, eos_token_id=1)
"""The tiny ``deepseek_v4`` config's fields (``DeepseekV4Config``)."""

_DSV3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=97, max_position_embeddings=256,
             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
             topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0,
             tie_word_embeddings=False)
# four layers: three gated DeltaNet, the fourth full attention (transformers' default pattern)
_QWEN35 = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, vocab_size=97, max_position_embeddings=256, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
               num_experts_per_tok=2, tie_word_embeddings=False)
_VISION = {"kimi_k25": dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                            num_attention_heads=2),
           "qwen3_5_moe": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=64)}
_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=256,
              tie_word_embeddings=False)
_QWEN3_MOE = dict(_QWEN3, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)

TINY_TYPES = ("qwen3", "qwen3_moe", *DSA_TYPES, "deepseek_v3", "kimi_k25", "qwen3_5_moe_text",
              "qwen3_5_moe", "deepseek_v4")
"""Every ``model_type`` :func:`tiny_config` makes: the embedded model's two and the family
room's (``replayrl.rollout.model.families.FAMILIES``)."""

_NOT_SCALED = {"dsa": ("norm", "sinks"), "deepseek_v4": ("norm", "sinks", "hc"),
               "other": ("norm", "A_log", "dt_bias")}
"""Per group of types, the parameters left as transformers initialised them (by name part)."""


def _group(model_type: str) -> str:
    if model_type not in TINY_TYPES:
        raise ValueError(f"no tiny config of model_type {model_type!r}; known: {', '.join(TINY_TYPES)}")
    return "dsa" if model_type in DSA_TYPES else "deepseek_v4" if model_type == "deepseek_v4" else "other"


def tiny_config(model_type: str, **overrides: Any):
    """transformers' config of the tiny ``model_type`` (the module docstring's shapes), with
    ``overrides`` (for the composites ``kimi_k25`` / ``qwen3_5_moe``: of the text config).
    Eager attention is set on the configs of :data:`DSA_TYPES` and ``deepseek_v4``; the others
    get it at :func:`tiny_checkpoint`'s ``from_config``.

    Raises:
        ValueError: a ``model_type`` outside :data:`TINY_TYPES` (the message lists them).
    """
    from transformers import AutoConfig

    group = _group(model_type)
    if group == "dsa":
        kw = dict(_BASE)
        if model_type == "gpt_oss":
            kw.update(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8)
        else:
            kw.update(_MLA)
            if model_type != "glm4_moe_lite":
                kw.update(_DSA)
        cfg = AutoConfig.for_model(model_type, **{**kw, **overrides})
        cfg._attn_implementation = "eager"
        return cfg
    if group == "deepseek_v4":
        cfg = AutoConfig.for_model("deepseek_v4", **{**TINY_V4, **overrides})
        cfg._attn_implementation = "eager"
        return cfg
    if model_type in ("qwen3", "qwen3_moe"):
        return AutoConfig.for_model(model_type, **{**(_QWEN3 if model_type == "qwen3" else _QWEN3_MOE),
                                                   **overrides})
    if model_type in ("deepseek_v3", "kimi_k25"):
        text = dict(_DSV3, **overrides)
        if model_type == "kimi_k25":
            return AutoConfig.for_model("kimi_k25", text_config=dict(model_type="deepseek_v3", **text),
                                        vision_config=_VISION[model_type], projection_hidden_size=32,
                                        tie_word_embeddings=False)
        return AutoConfig.for_model(model_type, **text)
    text = dict(_QWEN35, **overrides)
    if model_type == "qwen3_5_moe":
        return AutoConfig.for_model("qwen3_5_moe", text_config=text,
                                    vision_config=_VISION[model_type], tie_word_embeddings=False)
    return AutoConfig.for_model(model_type, **text)


def tiny_checkpoint(model_type: str, directory: str | Path, seed: int = 0, scale: float | None = None,
                    **overrides: Any):
    """Write a random tiny ``model_type`` checkpoint (config.json and sharded safetensors, by
    transformers' ``save_pretrained``) to ``directory``; returns transformers' float32 model of
    it in eval mode (a composite: its image-text-to-text model).

    Args:
        model_type: one of :data:`TINY_TYPES`.
        directory: where to write (created).
        seed: ``torch.manual_seed`` of the initialisation (and of ``deepseek_v4``'s hash tables
            and compressor position biases, a generator of that seed).
        scale: factor on the weights other than norms (default 5 for :data:`DSA_TYPES`, else 3).
        overrides: config fields (:func:`tiny_config`).
    Raises:
        ValueError: a ``model_type`` outside :data:`TINY_TYPES`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    group = _group(model_type)
    if scale is None:
        scale = 5.0 if group == "dsa" else 3.0
    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **overrides)
    if group == "other":
        auto = AutoModelForImageTextToText if model_type in _VISION else AutoModelForCausalLM
        model = auto.from_config(cfg, attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    keep = _NOT_SCALED[group]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not any(part in name for part in keep):
                p.mul_(scale)
            if group == "deepseek_v4" and name.endswith("position_bias"):
                p.normal_(0.0, 1.0, generator=g)
        for name, b in model.named_buffers():
            if group == "deepseek_v4" and name.endswith("tid2eid"):  # distinct experts per token
                e = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(e, generator=g)[: b.shape[1]]
                                     for _ in range(b.shape[0])]))
    model.save_pretrained(directory, max_shard_size="200KB" if group == "deepseek_v4" else "60KB")
    return model.eval()


def main(family: str, out: Path, seed: int = 0) -> Path:
    """Write the checkpoint of ``family`` (config.json, sharded safetensors, tokenizer) to
    ``out`` (created); returns ``out``.

    Raises:
        ValueError: ``family`` is no model type of ``TINY_TYPES`` (the message lists them).
    """
    from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
    from replayrl.tools.run.launcher import write_embedded_tokenizer

    model = tiny_checkpoint(family, out, seed=seed)
    write_embedded_tokenizer(out)
    ids = {name: VOCABULARY.index(token) for name, token in
           (("pad_token_id", "<pad>"), ("bos_token_id", "<bos>"), ("eos_token_id", "<eos>"))}
    (Path(out) / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({family}, {params / 1e6:.2f} M parameters, the built-in task's tokenizer)")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=TINY_TYPES, help="the checkpoint's model_type")
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    main(args.family, args.out, args.seed)
