"""R3 routing replay and indexer replay: captured traces reproduce the forward exactly,
different traces change it (matching the naive float64 reference), -1 rows are safe."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from replayrl.rollout.model import ModelInputError, default_config
from tests.model_helpers import decisive_model

V = 32


def _reference():
    """The naive float64 forward of test_model_indexer.py, loaded by path (no tests package needed)."""
    spec = importlib.util.spec_from_file_location(
        "_model_naive_reference", Path(__file__).with_name("test_model_indexer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference


def _model(seed):
    return decisive_model(default_config(V), seed)


@pytest.fixture(scope="module")
def model():
    return _model(seed=31)


def _batch(seed, b=2, s=16):
    ids = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(s).expand(b, s)


def test_replaying_captured_traces_gives_identical_logits(model):
    ids, pos = _batch(0)
    with torch.no_grad():
        cap = model(ids, pos, capture=True)
        rep = model(ids, pos, routed_experts=cap.routed_experts, indexer_topk=cap.indexer_topk,
                    capture=True)
    assert torch.equal(rep.logits, cap.logits)
    assert torch.equal(rep.routed_experts, cap.routed_experts)
    assert torch.equal(rep.indexer_topk, cap.indexer_topk)


def test_replaying_other_experts_changes_logits_as_the_reference_says(model):
    reference = _reference()
    ids, pos = _batch(1, b=1, s=12)
    with torch.no_grad():
        cap = model(ids, pos, capture=True)
    other = (cap.routed_experts + 1) % model.config.num_experts  # distinct, all different
    with torch.no_grad():
        rep = model(ids, pos, routed_experts=other, capture=True)
    assert torch.equal(rep.routed_experts, other)
    assert (rep.logits - cap.logits).abs().max() > 1e-2
    ref_logits, ref_experts, _ = reference(model, ids[0].numpy(), expert_replay=other[0].numpy())
    assert np.array_equal(ref_experts, other[0].numpy())
    np.testing.assert_allclose(rep.logits[0].numpy(), ref_logits, atol=2e-5, rtol=0)


def test_replaying_other_keys_changes_logits_as_the_reference_says(model):
    reference = _reference()
    ids, pos = _batch(2, b=1, s=12)
    s, k = 12, model.config.index_topk
    # Each query keeps only itself and its predecessor (a tiny local window).
    keys = torch.full((1, s, 2, k), -1, dtype=torch.int32)
    keys[0, :, :, 0] = torch.arange(s)[:, None]
    keys[0, 1:, :, 1] = torch.arange(s - 1)[:, None]
    with torch.no_grad():
        cap = model(ids, pos)
        rep = model(ids, pos, indexer_topk=keys, capture=True)
    assert torch.equal(rep.indexer_topk, keys)
    assert (rep.logits - cap.logits).abs().max() > 1e-2
    ref_logits, _, ref_slots = reference(model, ids[0].numpy(), slot_replay=keys[0].numpy())
    assert np.array_equal(ref_slots, keys[0].numpy())
    np.testing.assert_allclose(rep.logits[0].numpy(), ref_logits, atol=2e-5, rtol=0)


def test_routing_weights_stay_differentiable_under_replay(model):
    ids, pos = _batch(3)
    with torch.no_grad():
        cap = model(ids, pos, capture=True)
    model.zero_grad(set_to_none=True)
    out = model(ids, pos, routed_experts=cap.routed_experts, indexer_topk=cap.indexer_topk)
    out.logits.logsumexp(-1).mean().backward()
    for layer in model.config.moe_layers:
        g = model.model.layers[layer].mlp.gate.weight.grad
        assert g is not None and g.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_all_minus_one_rows_keep_own_choice_and_stay_finite(model):
    # Right padding as in the trainer: row 1 ends with 5 padding tokens whose replay rows are -1,
    # and some real rows (observation tokens) carry no trace either.
    ids, pos = _batch(4)
    real = torch.ones(2, 16, dtype=torch.bool)
    real[1, 11:] = False
    with torch.no_grad():
        own = model(ids, pos, key_padding_mask=real, capture=True)
    experts = own.routed_experts.clone()
    keys = own.indexer_topk.clone()
    experts[1, 11:] = -1
    keys[1, 11:] = -1
    experts[0, 3:6] = -1
    keys[0, 3:6] = -1
    assert (keys[1, 11:] == -1).all() and (own.indexer_topk[1, 11:] == -1).all()
    model.zero_grad(set_to_none=True)
    out = model(ids, pos, key_padding_mask=real, routed_experts=experts, indexer_topk=keys,
                capture=True)
    assert torch.isfinite(out.logits).all()
    assert torch.equal(out.logits, own.logits)  # -1 rows fell back to the model's own choice
    assert torch.equal(out.routed_experts, own.routed_experts)
    out.logits.logsumexp(-1).sum().backward()  # padding rows included on purpose
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), name
    model.zero_grad(set_to_none=True)


def test_fully_padded_row_is_finite_with_and_without_replay(model):
    ids, pos = _batch(5, b=2, s=6)
    real = torch.ones(2, 6, dtype=torch.bool)
    real[0] = False  # a batch row of padding only
    empty_e = torch.full((2, 6, 3, 2), -1, dtype=torch.int32)
    empty_k = torch.full((2, 6, 2, 8), -1, dtype=torch.int32)
    model.zero_grad(set_to_none=True)
    for kwargs in ({}, {"routed_experts": empty_e, "indexer_topk": empty_k}):
        out = model(ids, pos, key_padding_mask=real, **kwargs)
        assert torch.isfinite(out.logits).all()
        out.logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)


def test_bad_expert_replay_is_rejected(model):
    ids, pos = _batch(6, b=1, s=3)
    good = torch.zeros(1, 3, 3, 2, dtype=torch.int32)
    good[..., 1] = 1
    bad = good.clone()
    bad[0, 0, 0, 1] = -1  # half a row
    with pytest.raises(ModelInputError, match="all -1 or all experts"):
        model(ids, pos, routed_experts=bad)
    bad = good.clone()
    bad[0, 1, 2, 1] = 0  # expert 0 twice
    with pytest.raises(ModelInputError, match="repeats"):
        model(ids, pos, routed_experts=bad)
    bad = good.clone()
    bad[0, 2, 0, 0] = 8  # no expert 8
    with pytest.raises(ModelInputError, match=r"\[-1, 8\)"):
        model(ids, pos, routed_experts=bad)
    with pytest.raises(ModelInputError, match="routed_experts"):
        model(ids, pos, routed_experts=good.float())
    with pytest.raises(ModelInputError, match="routed_experts"):
        model(ids, pos, routed_experts=good[:, :, :2])
