"""DeepSeek-V4 (`deepseek_v4`) behind `--hf-checkpoint` (rollout/model/families/deepseek_v4.py):
logits against transformers' own model, the top-k routers and the CSA indexers captured and
replayed, hash-routed layers checked instead of traced, the engine's mixed-length decode and the
compact trace codec on the compressed-entry rows.

References are transformers' unwrapped model (built and saved in the test), formulas written out
here (sqrt-softplus scores, the causal count of compressed entries) and single-prompt decoding."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.model.checkpoint import state_dict_arrays
from replayrl.rollout.model.errors import CheckpointError, ModelConfigError, ModelInputError
from replayrl.rollout.model.families.deepseek_v4 import DeepseekV4FamilyModel
from replayrl.rollout.model.families.run_check import check_run
from replayrl.rollout.model.hf_config import read_hf_config
from replayrl.rollout.model.loader import load_pretrained
from replayrl.rollout.sampling.sampling_params import SamplingParams
from replayrl.rollout.traces.trace_storage import decode_column, encode_column
from replayrl.rollout.traces.trace_table import spec as trace_spec
from tests.deepseek_v4_checkpoint import TINY_V4, tiny_v4_checkpoint

RATE = TINY_V4["compress_rates"]["compressed_sparse_attention"]
K_IDX = TINY_V4["index_topk"]


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(transformers' reference model, checkpoint dir)."""
    d = tmp_path_factory.mktemp("deepseek_v4")
    return tiny_v4_checkpoint(d), d


def _inputs(vocab: int, s: int = 22, seed: int = 3):
    """Two rows of `s` tokens, the second right-padded after 15 (the trainer's layout)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, s), generator=g)
    pos = torch.arange(s).expand(2, s).clone()
    mask = torch.ones(2, s, dtype=torch.bool)
    mask[1, 15:] = False
    return ids, pos, mask


def _sort(t):
    return t.long().sort(-1).values


def test_logits_match_transformers_and_only_top_k_and_csa_layers_are_traced(v4):
    ref, d = v4
    model, cfg = load_pretrained(d)
    assert isinstance(model, DeepseekV4FamilyModel)
    assert cfg.moe_layers == tuple(i for i, t in enumerate(TINY_V4["mlp_layer_types"]) if t == "moe")
    assert cfg.indexed_layers == tuple(i for i, t in enumerate(TINY_V4["layer_types"])
                                       if t == "compressed_sparse_attention")
    ids, pos, mask = _inputs(cfg.vocab_size)
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=pos, attention_mask=mask.long()).logits
        out = model.eval()(ids, pos, key_padding_mask=mask, capture=True)
    assert torch.allclose(out.logits[mask], want[mask], atol=1e-5, rtol=0)
    assert out.routed_experts.shape == (2, 22, 3, 2)  # the hash-routed layer 0 has no column
    assert out.indexer_topk.shape == (2, 22, 2, K_IDX)
    # query t may see the entries w < (t + 1) // 4: it picks min(index_topk, that) of them
    picked = (out.indexer_topk >= 0).sum(-1)
    seen = torch.clamp((pos + 1) // RATE, max=K_IDX)[..., None].expand_as(picked)
    assert torch.equal(picked[mask], seen[mask])
    assert bool((out.indexer_topk[~mask] == -1).all())  # padding queries pick nothing
    assert bool((out.indexer_topk < ((pos + 1) // RATE)[..., None, None]).all())


def test_captured_experts_are_the_biased_sqrt_softplus_top_k(v4):
    _, d = v4
    model, cfg = load_pretrained(d)
    gate = model.hf.model.layers[2].mlp.gate
    with torch.no_grad():  # a strong bias moves the choice: capture must follow it
        gate.e_score_correction_bias.copy_(torch.linspace(-1, 1, 8))
    seen = {}
    model.hf.model.layers[2].mlp.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    ids, pos, _ = _inputs(cfg.vocab_size)
    with torch.no_grad():
        out = model.eval()(ids, pos, capture=True)
    x = seen["x"].reshape(-1, seen["x"].shape[-1])
    scores = torch.sqrt(F.softplus(x @ gate.weight.T))
    want = (scores + gate.e_score_correction_bias).topk(2, dim=-1).indices
    assert torch.equal(_sort(out.routed_experts[:, :, 1]).reshape(-1, 2), _sort(want))


def _perturb(model, g):
    """Move the choices: the routers' bias correction (it only ranks) and the indexers'
    projections; in place."""
    with torch.no_grad():
        for name, p in list(model.hf.named_parameters()) + list(model.hf.named_buffers()):
            if name.endswith("e_score_correction_bias") or (
                    ".indexer." in name and name.endswith("proj.weight")):
                p.add_(3.0 * p.abs().mean().clamp(min=0.3) * torch.randn(p.shape, generator=g))


def test_replay_restores_the_recorded_choices_after_routers_and_indexers_moved(v4):
    _, d = v4
    model, cfg = load_pretrained(d)
    model.eval()
    ids, pos, mask = _inputs(cfg.vocab_size)
    with torch.no_grad():
        rec = model(ids, pos, key_padding_mask=mask, capture=True)
        _perturb(model, torch.Generator().manual_seed(11))
        moved = model(ids, pos, key_padding_mask=mask, capture=True)
        rep = model(ids, pos, key_padding_mask=mask, capture=True,
                    routed_experts=rec.routed_experts, indexer_topk=rec.indexer_topk)
    assert not torch.equal(_sort(moved.routed_experts), _sort(rec.routed_experts))  # they moved
    assert not torch.equal(_sort(moved.indexer_topk), _sort(rec.indexer_topk))
    assert torch.equal(_sort(rep.routed_experts), _sort(rec.routed_experts))       # flips 0
    assert torch.equal(_sort(rep.indexer_topk), _sort(rec.indexer_topk))
    # the bias and the indexer only choose: with the choices restored, so are the logits (the
    # replayed experts' weights recomputed from the live router's sqrt-softplus scores)
    assert torch.allclose(rep.logits[mask], rec.logits[mask], atol=1e-5, rtol=0)
    assert (moved.logits[mask] - rec.logits[mask]).abs().max() > 1e-2


def test_minus_one_selects_nothing_and_an_all_minus_one_row_keeps_the_indexer(v4):
    _, d = v4
    model, cfg = load_pretrained(d)
    ids, pos, _ = _inputs(cfg.vocab_size)
    with torch.no_grad():
        rec = model(ids, pos, capture=True)
    slots = rec.indexer_topk.clone()
    slots[:, 12:, :, 1:] = -1           # one entry per query from 12 on
    slots[0, 20] = -1                   # an all -1 row: the indexer's own choice
    out = model(ids, pos, indexer_topk=slots, capture=True)
    given = slots >= 0
    assert torch.equal(out.indexer_topk[given], slots[given])
    assert torch.equal(out.indexer_topk[0, 20], out.own_indexer_topk[0, 20])
    # a -1 adds no entry: the same one entry repeated is the same attention
    same = torch.where(slots[:, 12:] >= 0, slots[:, 12:], slots[:, 12:, :, :1])
    repeated = slots.clone()
    repeated[:, 12:] = same
    repeated[0, 20] = -1
    with torch.no_grad():
        twice = model(ids, pos, indexer_topk=repeated)
    assert torch.allclose(twice.logits, out.logits.detach(), atol=1e-6, rtol=0)
    logp = torch.log_softmax(out.logits.float(), -1)
    logp[..., 0].sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    future = rec.indexer_topk.clone()
    future[1, 7, 0, 0] = 2              # query 7 sees the entries 0 and 1 only
    with pytest.raises(ModelInputError, match="indexer_topk .* query 7 of batch row 1 .* layer 1"):
        model(ids, pos, indexer_topk=future)


def test_hash_routed_tables_are_checked_at_every_push_naming_the_layer(v4):
    _, d = v4
    trainer, cfg = load_pretrained(d)
    assert 0 not in cfg.moe_layers  # hash-routed: no trace column
    engine = EmbeddedEngine(cfg, dtype=torch.float32)
    arrays = state_dict_arrays(trainer)
    name = "model.layers.0.mlp.gate.tid2eid"
    for bad, why in ((2.5, "hash token 4"), (8.0, r"outside \[0, 8\)")):
        broken = dict(arrays)
        broken[name] = arrays[name].copy()
        broken[name][4, 1] = bad
        with pytest.raises(CheckpointError, match=f"{name}.*{why}"):
            engine.load_weights(broken, version=0)
    engine.load_weights(arrays, version=0)
    assert torch.equal(engine.model.hf.state_dict()[name], trainer.hf.state_dict()[name])


def test_left_padding_and_positions_off_their_slots_are_refused(v4):
    _, d = v4
    model, cfg = load_pretrained(d)
    ids, pos, mask = _inputs(cfg.vocab_size)
    left = mask.flip(1)
    with pytest.raises(ModelInputError, match="key_padding_mask: row 1 .* slot 0"):
        model(ids, pos, key_padding_mask=left)
    with pytest.raises(ModelInputError, match="position_ids: row 0 slot 0"):
        model(ids, pos + 1, key_padding_mask=mask)


@pytest.mark.parametrize("field,value", [("num_nextn_predict_layers", 1),
                                         ("quantization_config", {"quant_method": "fp8"}),
                                         ("attention_dropout", 0.1)])
def test_fields_the_code_does_not_reproduce_are_refused_naming_them(field, value, v4, tmp_path):
    _, d = v4
    hf = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, field: value}))
    with pytest.raises(ModelConfigError, match=field):
        read_hf_config(tmp_path)


def test_packing_is_refused_naming_the_flag():
    run = SimpleNamespace(policy_config=SimpleNamespace(family="deepseek_v4"),
                          trainer=SimpleNamespace(use_packing=True))
    with pytest.raises(ModelConfigError, match="--use-packing"):
        check_run(run)


def test_mixed_length_decode_gives_each_prompt_what_it_gets_alone(v4):
    _, d = v4
    trainer, cfg = load_pretrained(d)
    engine = EmbeddedEngine(cfg, dtype=torch.float32)
    engine.load_weights(state_dict_arrays(trainer), version=0)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (5, 9, 9, 14)]
    kw = dict(max_new_tokens=9, eos_token_id=1, seed=7,
              traces=frozenset({"routed_experts", "indexer_topk"}))
    params = SamplingParams()
    together = engine.generate(prompts, params, **kw)
    for i in (0, 3):  # alone in their length: exactly what a call of their own gets
        alone = engine.generate([prompts[i]], params, **kw)[0]
        for field in ("response_ids", "rollout_logprobs", "routed_experts", "indexer_topk"):
            assert np.array_equal(getattr(together[i], field), getattr(alone, field)), field
    # every row, the two sharing a length included, is the trainer's right-padded forward of
    # that trajectory with the engine's choices replayed
    seqs = [p + g.response_ids.tolist() for p, g in zip(prompts, together)]
    s = max(len(x) for x in seqs) - 1
    ids = torch.zeros(4, s, dtype=torch.long)
    mask = torch.zeros(4, s, dtype=torch.bool)
    routed = torch.full((4, s, len(cfg.moe_layers), 2), -1, dtype=torch.int32)
    index = torch.full((4, s, len(cfg.indexed_layers), K_IDX), -1, dtype=torch.int32)
    for i, (x, g) in enumerate(zip(seqs, together)):
        n = len(x) - 1
        ids[i, :n], mask[i, :n] = torch.tensor(x[:-1]), True
        routed[i, :n] = torch.from_numpy(g.routed_experts)
        index[i, :n] = torch.from_numpy(g.indexer_topk)
    with torch.no_grad():
        out = trainer(ids, torch.arange(s).expand(4, s), key_padding_mask=mask,
                      routed_experts=routed, indexer_topk=index)
    logp = torch.log_softmax(out.logits.float(), -1)
    for i, (p, g) in enumerate(zip(prompts, together)):
        r = len(g.response_ids)
        got = logp[i, len(p) - 1: len(p) - 1 + r].gather(-1, torch.from_numpy(
            g.response_ids.astype(np.int64))[:, None])[:, 0]
        assert torch.allclose(got, torch.from_numpy(g.rollout_logprobs), atol=1e-5, rtol=0), i
    # the compact wire form holds the compressed-entry rows: each row a set of the (p + 1) // RATE
    # entries its query sees (the first query to see an entry picks it: the stride is RATE)
    column = np.concatenate([g.indexer_topk for g in together])
    counts = [len(g.indexer_topk) for g in together]
    wire = encode_column(trace_spec("indexer_topk"), column, counts)
    assert isinstance(wire, dict) and wire["codec"] == "sets" and wire["stride"] == RATE
    back = decode_column(trace_spec("indexer_topk"), wire, counts)
    assert np.array_equal(np.sort(back, -1), np.sort(column, -1))
