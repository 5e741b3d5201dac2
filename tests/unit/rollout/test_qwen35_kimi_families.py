"""The `deepseek_v3` / `kimi_k25` and `qwen3_5_moe` families (rollout/model/families/):
transformers' own models behind `--hf-checkpoint`, routing capture / replay at every MoE layer,
the engine's decode over gated DeltaNet state, and what they refuse before start.

References are transformers' own models (for a multimodal composite: its image-text-to-text
model run on text), built and saved in the test; replayed weights are recomputed here by hand."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.model.checkpoint import state_dict_arrays
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.errors import ModelConfigError, ModelInputError
from replayrl.rollout.model.hf_config import read_hf_config
from replayrl.rollout.model.loader import load_pretrained
from replayrl.rollout.sampling.sampling_params import SamplingParams
from tests.family_checkpoints import padded_inputs
from tests.qwen35_kimi_checkpoints import TYPES, tiny_checkpoint


@pytest.fixture(scope="module", params=TYPES)
def family(request, tmp_path_factory):
    """(model_type, transformers' reference model, checkpoint dir)."""
    d = tmp_path_factory.mktemp(request.param)
    return request.param, tiny_checkpoint(request.param, d), d


def test_logits_equal_transformers_and_every_moe_layer_is_traced(family):
    model_type, ref, d = family
    model, cfg = load_pretrained(d)
    assert cfg.family == model_type
    ids, pos, mask = padded_inputs(cfg.vocab_size)
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=pos, attention_mask=mask.long()).logits
        out = model.eval()(ids, pos, key_padding_mask=mask, capture=True)
    assert torch.allclose(out.logits[mask], want[mask], atol=1e-5, rtol=0)
    text = ref.config.get_text_config()
    moe = [i for i in range(text.num_hidden_layers)
           if model_type.startswith("qwen") or i >= text.first_k_dense_replace]
    assert list(cfg.moe_layers) == moe
    assert out.routed_experts.shape == (2, 12, len(moe), text.num_experts_per_tok)
    assert not any("vision" in n or "visual" in n or "projector" in n
                   for n in model.state_dict())  # the text tower only


def _router_input_and_weights(model, layer):
    """Hooks recording layer `layer`'s MoE input and the (experts, weights) its experts ran."""
    seen = {}
    mlp = model.hf.model.layers[layer].mlp
    mlp.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    mlp.experts.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("used", (a[1].long(), a[2].float())))
    return seen


def _weights_by_hand(model_type, gate, x, experts):
    """The routing weights of `experts` ([N, K]) from the live router on input `x`: Qwen3.5
    softmax over all experts renormalised over the chosen; DeepSeek-V3 sigmoid, renormalised
    (norm_topk_prob), times routed_scaling_factor."""
    logits = x.reshape(-1, x.shape[-1]).float() @ gate.weight.float().T
    if model_type.startswith("qwen"):
        w = logits.softmax(-1).gather(1, experts)
        return w / w.sum(-1, keepdim=True)
    w = logits.sigmoid().gather(1, experts)
    if gate.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * gate.routed_scaling_factor


@pytest.mark.parametrize("model_type", ["kimi_k25", "qwen3_5_moe"])
def test_replay_after_router_perturbation_restores_choices_and_live_weights(model_type, tmp_path):
    tiny_checkpoint(model_type, tmp_path)
    model, cfg = load_pretrained(tmp_path)
    model.eval()
    ids, pos, mask = padded_inputs(cfg.vocab_size)
    layer = cfg.moe_layers[-1]
    seen = _router_input_and_weights(model, layer)
    with torch.no_grad():
        rec = model(ids, pos, key_padding_mask=mask, capture=True)
        g = torch.Generator().manual_seed(11)
        for i in cfg.moe_layers:  # move every router
            w = model.hf.model.layers[i].mlp.gate.weight
            w.add_(3.0 * w.abs().mean() * torch.randn(w.shape, generator=g))
        moved = model(ids, pos, key_padding_mask=mask, capture=True)
        rep = model(ids, pos, key_padding_mask=mask, capture=True,
                    routed_experts=rec.routed_experts)
    sort = lambda t: t.long().sort(-1).values
    assert not torch.equal(sort(moved.routed_experts), sort(rec.routed_experts))  # it moved
    assert torch.equal(sort(rep.routed_experts), sort(rec.routed_experts))       # flips 0
    experts, weights = seen["used"]
    j = len(cfg.moe_layers) - 1
    assert torch.equal(experts, rec.routed_experts[:, :, j].reshape(-1, experts.shape[1]).long())
    gate = model.hf.model.layers[layer].mlp.gate
    want = _weights_by_hand(model_type, gate, seen["x"], experts)
    assert torch.allclose(weights, want, atol=1e-6, rtol=0)


def _engine(model, cfg):
    engine = EmbeddedEngine(cfg, dtype=torch.float32)
    engine.load_weights(state_dict_arrays(model), version=0)
    return engine


def test_qwen35_batched_decode_of_unequal_prompts_equals_each_alone(tmp_path):
    # left-padded prompts of 3, 9 and 6 tokens decode from the DeltaNet layers' carried
    # convolution and recurrent state (transformers' DynamicCache) as each prompt alone does
    tiny_checkpoint("qwen3_5_moe", tmp_path)
    model, cfg = load_pretrained(tmp_path)
    model.eval()
    engine = _engine(model, cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (3, 9, 6)]
    kw = dict(max_new_tokens=6, eos_token_id=0, seed=1, traces=frozenset({"routed_experts"}))
    greedy = SamplingParams(top_k=1)
    together = engine.generate(prompts, greedy, **kw)
    for p, g in zip(prompts, together):
        alone = engine.generate([p], greedy, **kw)[0]
        assert np.array_equal(g.response_ids, alone.response_ids)
        assert np.array_equal(g.routed_experts, alone.routed_experts)
    sampled = engine.generate(prompts, SamplingParams(), **kw)  # full-vocabulary logprobs
    for p, g in zip(prompts, sampled):  # each row alone, teacher-forced, no cache
        seq = torch.tensor([p + g.response_ids.tolist()[:-1]])
        with torch.no_grad():
            out = model(seq, torch.arange(seq.shape[1])[None], capture=True)
        logp = out.logits[0, len(p) - 1:].log_softmax(-1)
        want = logp.gather(1, torch.from_numpy(g.response_ids).long()[:, None])[:, 0]
        assert np.allclose(g.rollout_logprobs, want.numpy(), atol=1e-5, rtol=0)
        assert np.array_equal(g.routed_experts, out.routed_experts[0].numpy())


def test_qwen35_packed_rows_are_refused_naming_the_argument(tmp_path):
    tiny_checkpoint("qwen3_5_moe_text", tmp_path)
    model, cfg = load_pretrained(tmp_path)
    ids, pos, _ = padded_inputs(cfg.vocab_size)
    with pytest.raises(ModelInputError, match="segment_ids: packed rows are not supported"):
        model(ids, pos, segment_ids=torch.zeros_like(ids))


@pytest.mark.parametrize("model_type,field,value", [
    ("qwen3_5_moe", "text_config.mtp_num_hidden_layers", 1),
    ("qwen3_5_moe_text", "mtp_num_hidden_layers", 1),
    ("kimi_k25", "text_config.num_nextn_predict_layers", 1),
    ("deepseek_v3", "num_nextn_predict_layers", 1),
    ("kimi_k25", "text_config.quantization_config", {"quant_method": "compressed-tensors"}),
])
def test_fields_the_family_does_not_run_are_refused_naming_them(model_type, field, value,
                                                                tmp_path):
    from tests.qwen35_kimi_checkpoints import tiny_config

    d = tiny_config(model_type).to_dict()
    scope = d["text_config"] if field.startswith("text_config.") else d
    scope[field.rsplit(".", 1)[-1]] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ModelConfigError, match=f"'{field}'"):
        read_hf_config(tmp_path)


def test_an_unsupported_model_type_lists_every_family_of_the_registry():
    from replayrl.rollout.model.families import FAMILIES

    with pytest.raises(ModelConfigError) as err:
        ModelConfig.from_hf_dict({"model_type": "llama"})
    assert "qwen3, qwen3_moe" in str(err.value)
    assert all(name in str(err.value) for name in FAMILIES)
    assert {"deepseek_v3", "kimi_k25", "qwen3_5_moe"} <= set(FAMILIES)
