"""The vLLM engine against the real vLLM (skipped where vllm is not installed; CI runs it in
its own venv, see .ci/run).

References are computed independently of the engine: the embedded fp32 model (checked against
transformers in test_model_hf_parity.py) forwards each returned trajectory, and the processed
distribution (temperature, top-k, top-p) is rebuilt here by hand from its logits.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from replayrl.rollout.engines.vllm_engine import VllmEngine  # noqa: E402
from replayrl.rollout.errors import CaptureError, EngineError, EngineInputError, EngineTimeout  # noqa: E402
from replayrl.rollout.model.checkpoint import state_dict_arrays  # noqa: E402
from replayrl.rollout.model.config import default_config, without_indexer  # noqa: E402
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from replayrl.rollout.sampling.sampling_params import SamplingParams  # noqa: E402
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY  # noqa: E402

CFG = without_indexer(default_config(len(VOCABULARY)))
EOS = VOCABULARY.index("<eos>")
BOTH = frozenset({"sample_support", "routed_experts"})


def _model(seed: int) -> Qwen3MoeForCausalLM:
    model = Qwen3MoeForCausalLM(CFG)
    model.init_weights(seed)
    return model.eval()


@pytest.fixture(scope="module")
def engine():
    # prefix caching on (the MoE default is off) so the cache-hit and cache-reset cases are real
    eng = VllmEngine(dataclass_dict(CFG), dtype="float32", prefix_caching=True,
                     start_timeout_s=600, call_timeout_s=300)
    eng.load_weights(state_dict_arrays(_model(0)), version=0)
    return eng


def dataclass_dict(cfg):
    import dataclasses
    return dataclasses.asdict(cfg)  # as the launcher passes it across processes


def _reference_logits(model, context: list[int]) -> torch.Tensor:
    ids = torch.tensor([context])
    with torch.no_grad():
        out = model(ids, torch.arange(len(context))[None], capture=True)
    return out.logits[0].double(), out.routed_experts[0].numpy()


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, len(VOCABULARY), length).tolist() for _ in range(n)]


@pytest.mark.parametrize("params", [SamplingParams(top_k=5), SamplingParams(temperature=0.7),
                                    SamplingParams(top_k=8, top_p=0.6)])
def test_support_rows_and_logprobs_replay_the_trainers_distribution(engine, params):
    model = _model(0)
    prompts = _prompts(3, 9, seed=1)
    gens = engine.generate(prompts, params, max_new_tokens=6, eos_token_id=EOS, seed=5,
                           traces=BOTH)
    width = params.support_width(CFG.vocab_size)
    removed_any = False
    for prompt, g in zip(prompts, gens):
        r = len(g.response_ids)
        assert g.sample_support.shape == (r, 1 + width) and g.sample_support.dtype == np.int32
        assert (g.sample_support[:, 0] == g.response_ids).all()
        logits, _ = _reference_logits(model, prompt + g.response_ids[:-1].tolist())
        for k in range(r):
            z = logits[len(prompt) - 1 + k] / params.temperature
            order = torch.argsort(z, descending=True)[:width]
            probs = torch.softmax(z[order], -1)
            keep = (torch.cumsum(probs, -1) - probs) < params.top_p
            row = g.sample_support[k]
            assert set(row[1:][row[1:] >= 0].tolist()) == set(order[keep].tolist())
            assert (row[1:] == -1).sum() == (~keep).sum()  # vLLM's -inf -> -1
            removed_any |= bool((~keep).any())
            support = torch.tensor(row[1:][row[1:] >= 0].tolist())
            expected = z[int(g.response_ids[k])] - torch.logsumexp(z[support], -1)
            assert abs(float(expected) - float(g.rollout_logprobs[k])) < 1e-5
    assert removed_any == (params.top_p < 1)


def test_routing_is_the_models_own_choice_at_every_position(engine):
    model = _model(0)
    prompts = _prompts(2, 7, seed=2)
    gens = engine.generate(prompts, SamplingParams(), max_new_tokens=5, eos_token_id=EOS,
                           seed=1, traces=BOTH)
    for prompt, g in zip(prompts, gens):
        n = len(prompt) + len(g.response_ids) - 1
        assert g.routed_experts.shape == (n, len(CFG.moe_layers), CFG.num_experts_per_tok)
        assert g.routed_experts.dtype == np.int32 and not g.routed_experts.flags.writeable
        _, own = _reference_logits(model, prompt + g.response_ids[:-1].tolist())
        np.testing.assert_array_equal(np.sort(g.routed_experts, -1), np.sort(own, -1))
    # turn 2 of a multi-turn trajectory: its rows cover the whole context from position 0,
    # the first turn's part equal to the first turn's rows
    first = gens[0]
    context = prompts[0] + first.response_ids.tolist() + [3, 4]
    second = engine.generate([context], SamplingParams(), max_new_tokens=3, eos_token_id=EOS,
                             seed=2, traces=BOTH)[0]
    m = len(prompts[0]) + len(first.response_ids) - 1
    np.testing.assert_array_equal(np.sort(second.routed_experts[:m], -1),
                                  np.sort(first.routed_experts, -1))
    assert second.routed_experts.shape[0] == len(context) + len(second.response_ids) - 1


def test_seeds_reproduce_and_equal_prompts_sample_independently(engine):
    prompts = _prompts(1, 6, seed=3) * 6
    a = engine.generate(prompts, SamplingParams(), max_new_tokens=6, eos_token_id=EOS, seed=7,
                        traces=frozenset())
    b = engine.generate(prompts, SamplingParams(), max_new_tokens=6, eos_token_id=EOS, seed=7,
                        traces=frozenset())
    assert [g.response_ids.tolist() for g in a] == [g.response_ids.tolist() for g in b]
    assert len({tuple(g.response_ids.tolist()) for g in a}) > 1
    assert all(g.sample_support is None and g.routed_experts is None for g in a)


def test_stop_id_and_max_new_tokens(engine):
    # greedy (top_k=1) towards whichever token the model prefers; make that EOS by asking
    # with eos = the greedy first token
    prompt = _prompts(1, 5, seed=4)
    first = engine.generate(prompt, SamplingParams(top_k=1), max_new_tokens=1, eos_token_id=EOS,
                            seed=0, traces=frozenset())[0].response_ids[0]
    g = engine.generate(prompt, SamplingParams(top_k=1), max_new_tokens=4,
                        eos_token_id=int(first), seed=0, traces=frozenset())[0]
    assert g.finish_reason == "stop" and g.response_ids.tolist() == [first]
    g = engine.generate(prompt, SamplingParams(top_k=1), max_new_tokens=4,
                        eos_token_id=(int(first) + 1) % CFG.vocab_size, seed=0,
                        traces=frozenset())[0]
    assert g.finish_reason in ("length", "stop") and len(g.response_ids) <= 4


def test_weight_push_changes_vllms_logprobs_to_the_pushed_weights_and_resets_the_cache(engine):
    prompt = _prompts(1, 140, seed=5)  # > one KV block: a second call would hit the cache
    engine.generate(prompt, SamplingParams(), max_new_tokens=2, eos_token_id=EOS, seed=0,
                    traces=frozenset({"sample_support"}))
    # same version, same prompt: the cached prefix is never forwarded again, so the routing
    # trace would be missing there -> an error naming the prompt, never a zero replay
    with pytest.raises(EngineError, match=r"prompt 0: field routed_experts.*no routing"):
        engine.generate(prompt, SamplingParams(), max_new_tokens=2, eos_token_id=EOS, seed=0,
                        traces=BOTH)
    new = _model(1)
    engine.load_weights(state_dict_arrays(new), version=1)
    assert engine.version == 1
    g = engine.generate(prompt, SamplingParams(), max_new_tokens=4, eos_token_id=EOS, seed=0,
                        traces=BOTH)[0]  # cache reset by the push: every position forwarded
    logits, own = _reference_logits(new, prompt[0] + g.response_ids[:-1].tolist())
    start = len(prompt[0]) - 1
    expected = torch.log_softmax(logits[start:start + len(g.response_ids)], -1)
    expected = expected.gather(1, torch.tensor(g.response_ids, dtype=torch.long)[:, None])[:, 0]
    # fp32 kernels (vLLM's CPU attention and fused MoE vs plain torch)
    np.testing.assert_allclose(g.rollout_logprobs, expected.numpy(), atol=1e-5)
    np.testing.assert_array_equal(np.sort(g.routed_experts, -1), np.sort(own, -1))
    engine.load_weights(state_dict_arrays(_model(0)), version=2)  # back for later tests


def test_a_push_during_a_generation_waits_for_it(engine):
    import threading

    old, new = _model(0), _model(4)
    engine.load_weights(state_dict_arrays(old), version=engine.version + 1)
    prompts = _prompts(16, 20, seed=8)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("gens", engine.generate(
        prompts, SamplingParams(), max_new_tokens=40, eos_token_id=EOS, seed=0,
        traces=frozenset({"sample_support"}))))
    worker.start()
    while not engine._llm.llm_engine.has_unfinished_requests() and worker.is_alive():
        time.sleep(0.001)
    assert worker.is_alive()  # the push below is issued while vLLM generates
    engine.load_weights(state_dict_arrays(new), version=engine.version + 1)
    worker.join()
    # every token of every response was sampled under the old weights: none under the new
    for prompt, g in zip(prompts, result["gens"]):
        logits, _ = _reference_logits(old, prompt + g.response_ids[:-1].tolist())
        lp = torch.log_softmax(logits[len(prompt) - 1:], -1)
        lp = lp.gather(1, torch.tensor(g.response_ids, dtype=torch.long)[:, None])[:, 0]
        np.testing.assert_allclose(g.rollout_logprobs, lp.numpy(), atol=1e-5)
    engine.load_weights(state_dict_arrays(old), version=engine.version + 1)


def test_bad_push_is_refused_before_vllm_sees_it(engine):
    arrays = dict(state_dict_arrays(_model(3)))
    arrays.pop("lm_head.weight")
    with pytest.raises(EngineInputError, match="missing keys.*lm_head.weight"):
        engine.load_weights(arrays, version=engine.version + 1)
    arrays = dict(state_dict_arrays(_model(3)))
    arrays["lm_head.weight"] = arrays["lm_head.weight"][:, :3]
    with pytest.raises(EngineInputError, match="shape mismatch for 'lm_head.weight'"):
        engine.load_weights(arrays, version=engine.version + 1)


def test_a_misaligned_logprob_capture_is_an_error_naming_the_prompt(engine):
    prompt = _prompts(1, 6, seed=6)[0]
    outs, _ = engine._run("generate", 60, engine._step_all, ["probe-0"], [prompt],
                          [engine._vllm.SamplingParams(max_tokens=3, logprobs=4,
                                                       flat_logprobs=True, top_k=4, seed=1,
                                                       detokenize=False)], False)
    out = outs["probe-0"]
    flat = out.outputs[0].logprobs
    flat.token_ids[flat.start_indices[1]] = (out.outputs[0].token_ids[1] + 1) % CFG.vocab_size
    with pytest.raises(CaptureError, match="position 1: vLLM's first logprob is not the sampled"):
        engine._to_generation(4, prompt, out, 4, 3, EOS, frozenset({"sample_support"}), None)
    flat.start_indices.pop()
    with pytest.raises(CaptureError, match="logprobs for 2 of 3 positions"):
        engine._to_generation(4, prompt, out, 4, 3, EOS, frozenset({"sample_support"}), None)


def test_bad_requests_are_refused_with_the_field(engine):
    with pytest.raises(EngineInputError, match=r"prompts\[1\] holds token ids outside"):
        engine.generate([[3], [999]], SamplingParams(), max_new_tokens=2, eos_token_id=EOS,
                        seed=0, traces=frozenset())
    with pytest.raises(EngineInputError, match="greedy threshold"):
        engine.generate([[3]], SamplingParams(temperature=1e-6), max_new_tokens=2,
                        eos_token_id=EOS, seed=0, traces=frozenset())


def test_a_call_past_its_timeout_leaves_the_engine_unusable(engine):  # last: breaks the engine
    engine.call_timeout_s = 1e-3
    with pytest.raises(EngineTimeout, match="generate did not finish within"):
        engine.generate(_prompts(8, 100, seed=7), SamplingParams(), max_new_tokens=50,
                        eos_token_id=EOS, seed=0, traces=frozenset())
    with pytest.raises(EngineError, match="unusable: generate exceeded"):
        engine.generate([[3]], SamplingParams(), max_new_tokens=1, eos_token_id=EOS, seed=0,
                        traces=frozenset())
