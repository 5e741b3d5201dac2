"""Embedded engine tests: shapes, determinism, and agreement with one full forward per trajectory.

The independent check: for every generated trajectory, one unpadded, cache-free forward of
prompt + response through the same model gives logits z at every position; the behaviour logprob
must equal the support replay ``z_y - logsumexp_{v in S} z_v`` (written out here in float64
numpy), and the traces the engine captured must equal the ones this forward captures.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.actors.errors import DeviceError
from replayrl.rollout.engines.base import Generation
from replayrl.rollout.engines.embedded import EmbeddedEngine, _Forward, _PaddedBatch, _prefill
from replayrl.rollout.errors import EngineCaptureError, EngineInputError, EngineNotReady
from replayrl.rollout.model.checkpoint import state_dict_arrays
from replayrl.rollout.model.config import ModelConfig
from replayrl.rollout.model.errors import CheckpointError
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sample import TRACE_FIELDS
from replayrl.rollout.sampling.sampling_params import SamplingParams
from tests.devices import DEVICES

PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 8, 2, 6], [11], [3, 8, 12, 30, 1]]
TOP_K = 12
ALL = TRACE_FIELDS  # every trace the embedded engine captures


def tiny_config() -> ModelConfig:
    # Layer 0 dense, layers 1-2 MoE; the indexer keeps 4 keys, fewer than most trajectories
    # hold, so the sparse choice matters.
    return ModelConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=(0,), rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
        index_topk=4, index_n_heads=2, index_head_dim=8, index_layers=(1, 2),
    )


@pytest.fixture(scope="module")
def reference():
    """The fp32 model with random weights, and its weight push."""
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_config())
    model.init_weights(1)
    # Larger weights than the 0.02 init make the distributions peaked enough for top-p / min-p
    # to remove candidates, while logits stay O(1) so fp32 reduction-order noise stays small.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    model.eval()
    return model, state_dict_arrays(model)


def make_engine(arrays, dtype=torch.float32) -> EmbeddedEngine:
    engine = EmbeddedEngine(tiny_config(), dtype=dtype)
    engine.load_weights(arrays, version=0)
    return engine


def full_forward(model, prompt, response):
    """One unpadded forward of prompt + response[:-1] (the last token is never forwarded)."""
    ids = list(prompt) + [int(t) for t in response[:-1]]
    ids_t = torch.tensor([ids])
    pos = torch.arange(len(ids)).unsqueeze(0)
    with torch.no_grad():
        out = model(ids_t, pos, capture=True)
    return out


def support_replay_logprobs(logits: np.ndarray, response, support, temperature):
    """log p~(y_j) = z_y - logsumexp_{v in S_j} z_v, z = logits / T, rows of logits [R, V]."""
    out = []
    for j, y in enumerate(response):
        z = logits[j].astype(np.float64) / temperature
        s = [v for v in support[j, 1:] if v != -1]
        m = max(z[v] for v in s)
        out.append(z[y] - (m + np.log(sum(np.exp(z[v] - m) for v in s))))
    return np.array(out)


def pick_early_eos(probe: list[Generation], max_new_tokens: int) -> int:
    """A token to use as EOS so that some rows stop early while others go on.

    A rerun with the same seed draws exactly what ``probe`` drew until the first step at which
    either run finishes a row (the generator then serves fewer rows). So pick a token whose
    first appearance in any row, step s, lies in [1, max_new_tokens - 2], no later than the
    probe's first finish, and is reached at step s by some rows but not all.
    """
    stops = [len(g.response_ids) - 1 for g in probe if g.finish_reason == "stop"]
    earliest_stop = min(stops, default=max_new_tokens)
    responses = [g.response_ids.tolist() for g in probe]
    first = {}
    for r in responses:
        for step, t in enumerate(r):
            first[t] = min(first.get(t, step), step)
    for t, step in sorted(first.items(), key=lambda kv: (kv[1], kv[0])):
        hitters = sum(len(r) > step and r[step] == t for r in responses)
        if 1 <= step <= min(max_new_tokens - 2, earliest_stop) and 0 < hitters < len(responses):
            return t
    raise AssertionError("no token suits an early EOS; change the seed")


def test_not_ready_before_weight_load():
    engine = EmbeddedEngine(tiny_config())
    assert engine.version is None
    with pytest.raises(EngineNotReady, match="before the first load_weights"):
        engine.generate(PROMPTS, SamplingParams(), max_new_tokens=4, eos_token_id=0, seed=0, traces=ALL)


def test_shapes_dtypes_and_early_eos(reference):
    _, arrays = reference
    cfg = tiny_config()
    engine = make_engine(arrays, dtype=torch.bfloat16)
    params = SamplingParams(temperature=0.9, top_k=TOP_K)
    max_new = 8
    probe = engine.generate(PROMPTS, params, max_new_tokens=max_new, eos_token_id=0, seed=3, traces=ALL)
    eos = pick_early_eos(probe, max_new)
    gens = engine.generate(PROMPTS, params, max_new_tokens=max_new, eos_token_id=eos, seed=3, traces=ALL)
    assert len(gens) == len(PROMPTS)
    reasons = set()
    for prompt, g, p in zip(PROMPTS, gens, probe):
        P, R = len(prompt), len(g.response_ids)
        reasons.add(g.finish_reason)
        assert 1 <= R <= max_new
        if g.finish_reason == "stop":
            assert g.response_ids[-1] == eos and eos not in g.response_ids[:-1].tolist()
            assert R < max_new  # the early EOS picked above comes before the last step
            assert g.response_ids.tolist() == p.response_ids[:R].tolist()
        else:
            assert R == max_new and eos not in g.response_ids.tolist()
        assert g.response_ids.dtype == np.int32 and g.response_ids.shape == (R,)
        assert g.rollout_logprobs.dtype == np.float32 and g.rollout_logprobs.shape == (R,)
        assert np.isfinite(g.rollout_logprobs).all() and (g.rollout_logprobs <= 0).all()
        assert g.sample_support.dtype == np.int32 and g.sample_support.shape == (R, 1 + TOP_K)
        assert (g.sample_support[:, 0] == g.response_ids).all()
        assert g.routed_experts.dtype == np.int32
        assert g.routed_experts.shape == (P + R - 1, len(cfg.moe_layers), cfg.num_experts_per_tok)
        assert ((g.routed_experts >= 0) & (g.routed_experts < cfg.num_experts)).all()
        assert g.indexer_topk.dtype == np.int32
        assert g.indexer_topk.shape == (P + R - 1, len(cfg.indexed_layers), cfg.index_topk)
        # Query at position t may only pick keys at positions 0..t (causal, no padding).
        rows = np.arange(P + R - 1)[:, None, None]
        assert ((g.indexer_topk == -1) | ((g.indexer_topk >= 0) & (g.indexer_topk <= rows))).all()
        for arr in (g.response_ids, g.rollout_logprobs, g.sample_support, g.routed_experts, g.indexer_topk):
            assert not arr.flags.writeable
    assert reasons == {"stop", "length"}


def test_deterministic_per_seed(reference):
    _, arrays = reference
    engine = make_engine(arrays, dtype=torch.bfloat16)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    kw = dict(max_new_tokens=6, eos_token_id=31)
    a = engine.generate(PROMPTS, params, seed=11, **kw, traces=ALL)
    b = engine.generate(PROMPTS, params, seed=11, **kw, traces=ALL)
    c = engine.generate(PROMPTS, params, seed=12, **kw, traces=ALL)
    for ga, gb in zip(a, b):
        for field in ("response_ids", "rollout_logprobs", "sample_support", "routed_experts", "indexer_topk"):
            assert np.array_equal(getattr(ga, field), getattr(gb, field)), field
        assert ga.finish_reason == gb.finish_reason
    assert any(not np.array_equal(ga.response_ids, gc.response_ids) for ga, gc in zip(a, c))


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8, top_k=TOP_K, top_p=0.9), SamplingParams(min_p=0.05)],
    ids=repr,
)
@pytest.mark.parametrize(
    "dtype, atol",
    # fp32: batched, padded, cached matmuls reduce in another order than one unpadded forward,
    # so logits differ by ~1e-6 relative. fp64 removes that noise; what is left is the
    # sampler's float32 arithmetic.
    [(torch.float32, 2e-5), (torch.float64, 2e-6)],
    ids=["fp32", "fp64"],
)
def test_engine_matches_full_forward(reference, params, dtype, atol):
    model, arrays = reference
    model = Qwen3MoeForCausalLM(tiny_config()).to(dtype).eval()
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in arrays.items()})
    engine = make_engine(arrays, dtype=dtype)
    max_new = 10
    probe = engine.generate(PROMPTS, params, max_new_tokens=max_new, eos_token_id=0, seed=5, traces=ALL)
    eos = pick_early_eos(probe, max_new)
    gens = engine.generate(PROMPTS, params, max_new_tokens=max_new, eos_token_id=eos, seed=5, traces=ALL)
    assert {g.finish_reason for g in gens} == {"stop", "length"}
    removed = 0
    for prompt, g in zip(PROMPTS, gens):
        P = len(prompt)
        out = full_forward(model, prompt, g.response_ids)
        logits = out.logits[0, P - 1:].numpy()  # positions that predicted the response
        expected = support_replay_logprobs(logits, g.response_ids, g.sample_support, params.temperature)
        np.testing.assert_allclose(g.rollout_logprobs, expected, atol=atol, rtol=0)
        np.testing.assert_array_equal(g.routed_experts, out.routed_experts[0].numpy())
        # Unpadded and uncached, the full forward's key slots are positions already.
        np.testing.assert_array_equal(g.indexer_topk, out.indexer_topk[0].numpy())
        removed += int((g.sample_support[:, 1:] == -1).sum())
    assert removed > 0  # top-p / min-p did shape the support, so the replay set matters


def test_bf16_engine_differs_slightly_from_fp32_forward(reference):
    model, arrays = reference
    engine = make_engine(arrays, dtype=torch.bfloat16)
    params = SamplingParams(temperature=1.0, top_k=TOP_K)
    gens = engine.generate(PROMPTS, params, max_new_tokens=10, eos_token_id=31, seed=7, traces=ALL)
    diffs = []
    for prompt, g in zip(PROMPTS, gens):
        out = full_forward(model, prompt, g.response_ids)
        logits = out.logits[0, len(prompt) - 1:].float().numpy()
        expected = support_replay_logprobs(logits, g.response_ids, g.sample_support, 1.0)
        diffs.append(np.abs(g.rollout_logprobs - expected))
    diffs = np.concatenate(diffs)
    assert np.isfinite(diffs).all()
    assert diffs.mean() > 0.0
    assert diffs.mean() < 0.5


def test_requested_traces_only_and_sampling_unchanged(reference):
    _, arrays = reference
    engine = make_engine(arrays)
    full = engine.generate(PROMPTS, SamplingParams(top_k=TOP_K), max_new_tokens=3, eos_token_id=31,
                           seed=0, traces=ALL)
    for traces in ((), ("routed_experts",), ("sample_support", "indexer_topk")):
        gens = engine.generate(PROMPTS, SamplingParams(top_k=TOP_K), max_new_tokens=3,
                               eos_token_id=31, seed=0, traces=traces)
        for g, f in zip(gens, full):
            for name in ALL:
                assert (getattr(g, name) is None) == (name not in traces), name
                if name in traces:
                    assert np.array_equal(getattr(g, name), getattr(f, name)), name
            # what is captured never changes what is sampled
            assert np.array_equal(g.response_ids, f.response_ids)
            assert np.array_equal(g.rollout_logprobs, f.rollout_logprobs)


def test_unknown_trace_is_refused(reference):
    _, arrays = reference
    engine = make_engine(arrays)
    with pytest.raises(EngineCaptureError, match="EmbeddedEngine.*'expert_logits'"):
        engine.generate(PROMPTS, SamplingParams(), max_new_tokens=3, eos_token_id=31, seed=0,
                        traces=("expert_logits",))


def test_weight_version_never_moves_backwards(reference):
    _, arrays = reference
    engine = make_engine(arrays)
    engine.load_weights(arrays, version=3)
    assert engine.version == 3
    with pytest.raises(EngineInputError, match="backwards 3 -> 2"):
        engine.load_weights(arrays, version=2)
    with pytest.raises(EngineInputError, match="version"):
        engine.load_weights(arrays, version=-1)
    assert engine.version == 3


def test_load_weights_accepts_tensors_and_casts(reference):
    model, arrays = reference
    engine = EmbeddedEngine(tiny_config(), dtype=torch.bfloat16)
    engine.load_weights({k: v.detach().clone() for k, v in model.state_dict().items()}, version=0)
    assert engine.version == 0
    w = engine.model.lm_head.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, torch.from_numpy(np.array(arrays["lm_head.weight"])).to(torch.bfloat16))


@pytest.mark.parametrize(
    "prompts, kwargs, field",
    [
        ([], {}, "prompts"),
        ([[1, 2], []], {}, r"prompts\[1\]"),
        ([[1, 32]], {}, r"prompts\[0\]"),
        ([[1, -1]], {}, r"prompts\[0\]"),
        ([[1, 2.5]], {}, r"prompts\[0\]"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens"),
        ([[1]], {"max_new_tokens": 2.0}, "max_new_tokens"),
        ([[1]], {"seed": None}, "seed"),
        ([[1]], {"eos_token_id": 32}, "eos_token_id"),
        ([[1] * 60], {"max_new_tokens": 6}, "max_position_embeddings"),
    ],
)
def test_input_errors(reference, prompts, kwargs, field):
    _, arrays = reference
    engine = make_engine(arrays)
    args = {"max_new_tokens": 4, "eos_token_id": 0, "seed": 0, **kwargs}
    with pytest.raises(EngineInputError, match=field):
        engine.generate(prompts, SamplingParams(), **args, traces=ALL)


def test_bad_weight_push_leaves_engine_not_ready(reference):
    _, arrays = reference
    engine = EmbeddedEngine(tiny_config())
    partial = {k: v for k, v in arrays.items() if k != "lm_head.weight"}
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        engine.load_weights(partial, version=0)
    assert engine.version is None
    with pytest.raises(EngineInputError, match="lm_head.weight"):
        engine.load_weights({**partial, "lm_head.weight": [[0.0]]}, version=0)


def test_repeated_prompts_are_prefilled_once_and_generate_as_alone(reference):
    # a prompt group repeats its prompt; the engine prefills it once and shares the cache rows.
    # Greedy decoding (top-k 1) makes each row a function of its prompt alone, so every row
    # must equal the same prompt generated in a batch of one (which shares nothing).
    model, arrays = reference
    engine = make_engine(arrays)
    a, b, c = [3, 7, 1, 9], [5, 2], [0, 0, 5, 2]  # c: b's ids after left padding, unpadded
    prompts = [a, b, a, c, b, a]
    params = SamplingParams(temperature=1.0, top_k=1)
    kwargs = dict(max_new_tokens=4, eos_token_id=31, seed=3, traces=frozenset(TRACE_FIELDS))
    together = engine.generate(prompts, params, **kwargs)
    for prompt, gen in zip(prompts, together):
        alone = engine.generate([prompt], params, **kwargs)[0]
        assert gen.response_ids.tolist() == alone.response_ids.tolist()
        assert np.allclose(gen.rollout_logprobs, alone.rollout_logprobs, atol=1e-5)
        for field in TRACE_FIELDS:
            assert np.array_equal(getattr(gen, field), getattr(alone, field)), field


@pytest.mark.parametrize("device", DEVICES)
def test_the_model_and_its_kv_cache_live_on_the_device(reference, device):
    _, arrays = reference
    engine = EmbeddedEngine(tiny_config(), dtype=torch.float32, device=device)  # a --device name
    assert engine.device.type == device
    assert {p.device.type for p in engine.model.parameters()} == {device}
    engine.load_weights(arrays, version=0)
    assert {p.device.type for p in engine.model.parameters()} == {device}
    batch = _PaddedBatch([list(p) for p in PROMPTS], engine.device)
    forward = _Forward(engine.model, True, True)
    logits = _prefill(forward, batch)
    cache = forward.cache
    assert logits.device.type == device and cache._padding_mask.device.type == device
    assert {t.device.type for t in cache._keys + cache._values if t is not None} == {device}
    gens = engine.generate(PROMPTS, SamplingParams(temperature=0.9, top_k=TOP_K), max_new_tokens=4,
                           eos_token_id=0, seed=3, traces=ALL)
    # the generations leave the device as numpy arrays
    assert all(isinstance(g.response_ids, np.ndarray) and isinstance(g.routed_experts, np.ndarray)
               for g in gens)
    if device == "cpu":  # the CPU engine's output is the default engine's, bit for bit
        same = make_engine(arrays).generate(PROMPTS, SamplingParams(temperature=0.9, top_k=TOP_K),
                                            max_new_tokens=4, eos_token_id=0, seed=3, traces=ALL)
        for g, h in zip(gens, same):
            for name in ("response_ids", "rollout_logprobs", "sample_support", "routed_experts", "indexer_topk"):
                np.testing.assert_array_equal(getattr(g, name), getattr(h, name), err_msg=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_engine_without_cuda_is_refused():
    with pytest.raises(DeviceError, match="--device cuda, but torch sees no CUDA device"):
        EmbeddedEngine(tiny_config(), device="cuda")
