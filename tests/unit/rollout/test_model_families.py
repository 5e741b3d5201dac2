"""The family room (rollout/model/families/): transformers' deepseek_v32 / glm_moe_dsa /
glm4_moe_lite / gpt_oss models behind `--hf-checkpoint`, with router and indexer capture/replay.

References are transformers' own unwrapped models, built and saved in the test."""
from __future__ import annotations

import json

import pytest
import torch

from replayrl.rollout.model.errors import ModelConfigError, ModelInputError
from replayrl.rollout.model.hf_config import read_hf_config
from replayrl.rollout.model.loader import load_pretrained
from tests.family_checkpoints import FAMILY_TYPES, padded_inputs, tiny_hf_checkpoint


@pytest.fixture(scope="module", params=FAMILY_TYPES)
def family(request, tmp_path_factory):
    """(model_type, transformers' reference model, checkpoint dir)."""
    d = tmp_path_factory.mktemp(request.param)
    ref = tiny_hf_checkpoint(request.param, d)
    return request.param, ref, d


def test_sharded_checkpoint_logits_match_transformers(family):
    model_type, ref, d = family
    assert len(list(d.glob("model-*.safetensors"))) > 1  # sharded, with an index
    model, cfg = load_pretrained(d)
    assert cfg.family == model_type and cfg.moe_layers
    ids, pos, mask = padded_inputs(cfg.vocab_size)
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=pos, attention_mask=mask.long()).logits
        out = model.eval()(ids, pos, key_padding_mask=mask, capture=True)
    real = mask
    assert torch.allclose(out.logits[real], want[real], atol=1e-5, rtol=0)
    k = ref.config.num_experts_per_tok
    assert out.routed_experts.shape == (2, 12, len(cfg.moe_layers), k)
    assert torch.equal(out.routed_experts, out.own_routed_experts)
    if cfg.indexed_layers:
        assert out.indexer_topk.shape == (2, 12, len(cfg.indexed_layers), cfg.index_topk)
        # query i sees i + 1 keys: with index_topk 4 the first queries list -1 for the rest
        first = out.indexer_topk[0, 0, 0]
        assert first.tolist() == [0, -1, -1, -1]
        assert bool((out.indexer_topk[1, 8:] == -1).all())  # padding queries pick nothing


def _experts_by_hand(ref, layer, hidden):
    """The group-limited, bias-corrected top-k of transformers' router, recomputed here."""
    gate = ref.model.layers[layer].mlp.gate
    scores = torch.sigmoid(hidden.reshape(-1, hidden.shape[-1]).float() @ gate.weight.float().T)
    choice = scores + gate.e_score_correction_bias
    e, g = choice.shape[-1], gate.num_group
    group = choice.view(-1, g, e // g).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group).scatter_(1, group.topk(gate.topk_group, dim=-1).indices, 1)
    choice = choice.masked_fill(~keep.repeat_interleave(e // g, dim=1).bool(), float("-inf"))
    return choice.topk(gate.top_k, dim=-1).indices.sort(-1).values


def test_captured_experts_are_the_group_limited_biased_top_k(tmp_path):
    ref = tiny_hf_checkpoint("deepseek_v32", tmp_path)
    with torch.no_grad():  # a strong bias moves the choice: capture must follow it
        ref.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8))
    ref.save_pretrained(tmp_path, max_shard_size="60KB")
    model, cfg = load_pretrained(tmp_path)
    ids, pos, _ = padded_inputs(cfg.vocab_size)
    seen = {}
    ref.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    with torch.no_grad():
        ref(input_ids=ids, position_ids=pos)
        out = model.eval()(ids, pos, capture=True)
    want = _experts_by_hand(ref, 1, seen["x"]).view(2, 12, -1)
    assert torch.equal(out.routed_experts[:, :, 0].long().sort(-1).values, want)


def _perturb(model, routers: bool, indexers: bool):
    """Move the choices: router bias correction (DeepSeek / GLM; it only ranks) or router
    weight (gpt-oss), indexer weights. Returns nothing; in place."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in list(model.hf.named_parameters()) + list(model.hf.named_buffers()):
            hit = (routers and (name.endswith("gate.e_score_correction_bias")
                                or name.endswith("router.weight"))) or \
                  (indexers and ".indexer." in name and "weight" in name and "norm" not in name)
            if hit:
                p.add_(3.0 * p.abs().mean().clamp(min=0.3) * torch.randn(p.shape, generator=g))


def test_replay_restores_recorded_choices_after_perturbation(family):
    model_type, _, d = family
    model, cfg = load_pretrained(d)
    model.eval()
    ids, pos, mask = padded_inputs(cfg.vocab_size)
    with torch.no_grad():
        rec = model(ids, pos, key_padding_mask=mask, capture=True)
        _perturb(model, routers=True, indexers=True)
        moved = model(ids, pos, key_padding_mask=mask, capture=True)
        rep = model(ids, pos, key_padding_mask=mask, capture=True,
                    routed_experts=rec.routed_experts, indexer_topk=rec.indexer_topk)
    sort = lambda t: t.long().sort(-1).values
    assert not torch.equal(sort(moved.routed_experts), sort(rec.routed_experts))  # it moved
    assert torch.equal(sort(rep.routed_experts), sort(rec.routed_experts))       # flip 0
    if cfg.indexed_layers:
        assert not torch.equal(sort(moved.indexer_topk), sort(rec.indexer_topk))
        assert torch.equal(sort(rep.indexer_topk), sort(rec.indexer_topk))
    if model_type != "gpt_oss":
        # bias correction and indexer only choose: with the choices restored, so are the logits
        assert torch.allclose(rep.logits[mask], rec.logits[mask], atol=1e-5, rtol=0)
    else:  # gpt-oss weights come from the perturbed router's logits: the experts are restored
        assert bool(torch.isfinite(rep.logits).all())


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_indexer_rows_with_minus_one_give_finite_logprobs_and_gradients(model_type, tmp_path):
    tiny_hf_checkpoint(model_type, tmp_path)
    model, cfg = load_pretrained(tmp_path)
    ids, pos, _ = padded_inputs(cfg.vocab_size)
    with torch.no_grad():
        rec = model(ids, pos, capture=True)
    slots = rec.indexer_topk.clone()
    slots[:, 6:, :, 2:] = -1      # partly -1 rows
    slots[0, 9] = -1              # all -1 rows: the indexer's own choice
    out = model(ids, pos, indexer_topk=slots, capture=True)
    logp = torch.log_softmax(out.logits.float(), -1)
    assert bool(torch.isfinite(logp).all())
    logp[..., 0].sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    assert torch.equal(out.indexer_topk[0, 9], out.own_indexer_topk[0, 9])  # own choice kept
    given = slots >= 0
    assert torch.equal(out.indexer_topk[given], slots[given])  # the replayed slots were used
    partial = torch.ones_like(given[..., 0])
    partial[0, 9] = False
    assert bool((out.indexer_topk[:, 6:, :, 2:][partial[:, 6:]] == -1).all())


@pytest.mark.parametrize("name,extra", [("routed_experts", 1), ("routed_experts", -1),
                                        ("indexer_topk", 1), ("indexer_topk", -1)])
def test_trace_with_other_layer_count_is_refused_naming_the_field(name, extra, tmp_path):
    tiny_hf_checkpoint("glm_moe_dsa", tmp_path)
    model, cfg = load_pretrained(tmp_path)
    ids, pos, _ = padded_inputs(cfg.vocab_size)
    with torch.no_grad():
        rec = model(ids, pos, capture=True)
    trace = getattr(rec, name)
    trace = (torch.cat([trace, trace[:, :, :1]], dim=2) if extra > 0 else trace[:, :, 1:])
    with pytest.raises(ModelInputError, match=f"{name} has {trace.shape[2]} layer columns"):
        model(ids, pos, **{name: trace})


def test_shared_indexer_layers_store_once_and_replay_to_the_sharing_layer(tmp_path):
    tiny_hf_checkpoint("glm_moe_dsa", tmp_path, indexer_types=["full", "shared", "full"])
    model, cfg = load_pretrained(tmp_path)
    assert cfg.indexed_layers == (0, 2)
    ids, pos, _ = padded_inputs(cfg.vocab_size)
    with torch.no_grad():
        rec = model(ids, pos, capture=True)
        _perturb(model, routers=False, indexers=True)
        rep = model(ids, pos, capture=True, indexer_topk=rec.indexer_topk)
    assert rec.indexer_topk.shape[2] == 2
    assert torch.allclose(rep.logits, rec.logits, atol=1e-5, rtol=0)


def test_a_model_built_twice_replays_into_the_live_one(tmp_path):
    tiny_hf_checkpoint("deepseek_v32", tmp_path)
    first, cfg = load_pretrained(tmp_path)
    second, _ = load_pretrained(tmp_path)
    ids, pos, _ = padded_inputs(cfg.vocab_size)
    with torch.no_grad():
        rec = first(ids, pos, capture=True)
        _perturb(second, routers=True, indexers=True)
        rep = second(ids, pos, capture=True, routed_experts=rec.routed_experts,
                     indexer_topk=rec.indexer_topk)
        again = first(ids, pos, capture=True)
    sort = lambda t: t.long().sort(-1).values
    assert torch.equal(sort(rep.routed_experts), sort(rec.routed_experts))
    assert torch.equal(again.logits, rec.logits)  # the first model saw no replay of the second


def test_unknown_model_type_and_refused_fields_name_the_field(tmp_path):
    tiny_hf_checkpoint("gpt_oss", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "model_type": "deepseek_v4"}))
    with pytest.raises(ModelConfigError, match="model_type"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ModelConfigError, match="quantization_config"):
        read_hf_config(tmp_path)
