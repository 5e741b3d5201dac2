"""The SGLang engine against ``replayrl serve`` (the embedded engine behind SGLang's HTTP API) on
loopback, and against a proxy that breaks the server's replies one way at a time.

Reference: the in-process embedded engine with the same weights and seed (tested against
transformers in test_model_hf_parity.py); the client must reproduce its generations exactly,
and every broken reply must end in a typed error naming the request (or a recovery).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from replayrl.rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from replayrl.rollout.engines.sglang_engine import SglangEngine  # noqa: E402
from replayrl.rollout.engines.sglang_protocol import decode_item, encode_int32, generate_request, parse_generate_request  # noqa: E402
from replayrl.rollout.errors import (  # noqa: E402
    EngineNotReady,  # noqa: E402
    SglangRequestError,
    SglangResponseError,
    SglangUnavailable,
)
from replayrl.rollout.model.checkpoint import state_dict_arrays  # noqa: E402
from replayrl.rollout.model.config import ModelConfig, default_config  # noqa: E402
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from replayrl.rollout.sample import TRACE_FIELDS  # noqa: E402
from replayrl.rollout.sampling.sampling_params import SamplingParams  # noqa: E402
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY  # noqa: E402
from tests.sglang_fixtures import FaultProxy, corrupt_base64, drop_first_row, serve_thread  # noqa: E402

CFG = default_config(len(VOCABULARY))
EOS = VOCABULARY.index("<eos>")
ALL = frozenset(TRACE_FIELDS)
PARAMS = SamplingParams(temperature=1.0, top_k=6, top_p=0.9)


def _weights(seed: int = 0) -> dict:
    model = Qwen3MoeForCausalLM(CFG)
    model.init_weights(seed)
    return state_dict_arrays(model)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    distinct = [rng.integers(3, len(VOCABULARY), size=n).tolist() for n in (5, 7, 6)]
    return [distinct[0], distinct[0], distinct[1], distinct[2], distinct[1]]  # groups repeat


@pytest.fixture(scope="module")
def server():
    srv = serve_thread(CFG)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference():
    eng = EmbeddedEngine(CFG, dtype="float32")
    eng.load_weights(_weights(), version=0)
    return eng.generate(_prompts(), PARAMS, max_new_tokens=4, eos_token_id=EOS, seed=123,
                        traces=ALL)


def _engine(*urls: str, **kwargs) -> SglangEngine:
    eng = SglangEngine(dataclasses.asdict(CFG), urls=list(urls), dtype="float32",
                       call_timeout_s=60, start_timeout_s=30, **kwargs)
    eng.load_weights(_weights(), version=0)
    return eng


def _generate(eng: SglangEngine):
    return eng.generate(_prompts(), PARAMS, max_new_tokens=4, eos_token_id=EOS, seed=123,
                        traces=ALL)


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.finish_reason == w.finish_reason
        for name in ("response_ids", "rollout_logprobs", *TRACE_FIELDS):
            a, b = getattr(g, name), getattr(w, name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)
            assert not a.flags.writeable


def test_generations_through_the_server_equal_the_in_process_engine(reference):
    server = serve_thread(CFG)  # its own: this test moves the weights to version 1
    eng = _engine(server.url)
    with pytest.raises(EngineNotReady):
        SglangEngine(dataclasses.asdict(CFG), urls=server.url).generate(
            _prompts(), PARAMS, max_new_tokens=4, eos_token_id=EOS, seed=1, traces=ALL)
    _assert_same(_generate(eng), reference)
    # the push is an HF checkpoint directory: its config.json is the policy's shape
    written = json.loads((eng.weight_dir / "version-0" / "config.json").read_text())
    assert ModelConfig.from_hf_dict(written) == CFG
    # a second version replaces the first on disk and in the replies
    eng.load_weights(_weights(1), version=1)
    assert sorted(p.name for p in eng.weight_dir.iterdir()) == ["version-1"]
    again = _generate(eng)
    assert not all(np.array_equal(a.rollout_logprobs, b.rollout_logprobs)
                   for a, b in zip(again, reference))
    eng.close()
    # a second run on the same server starts again at version 0 (SGLang's weight_version is
    # a label, not a counter) and gets the same generations as the first run did
    second = _engine(server.url)
    _assert_same(_generate(second), reference)
    second.close()
    server.stop()


def _fault_case(server, fault):
    proxy = FaultProxy(server.url, fault)
    try:
        eng = _engine(proxy.url)
        with pytest.raises(SglangResponseError) as err:
            _generate(eng)
        eng.close()
        return str(err.value), err
    finally:
        proxy.stop()


def test_missing_routed_experts_on_the_second_request_is_named(server):
    def drop(items):
        del items[1]["meta_info"]["routed_experts"]

    message, _ = _fault_case(server, drop)
    assert "c1-1:" in message and "'routed_experts'" in message and "lacks" in message


def test_an_off_by_one_route_offset_is_refused(server):
    per_row = CFG.num_hidden_layers * CFG.num_experts_per_tok

    def shift(items):
        meta = items[0]["meta_info"]
        meta["routed_experts"] = drop_first_row(meta["routed_experts"], per_row)

    message, _ = _fault_case(server, shift)
    assert "c1-0:" in message and "off by one row" in message


def test_a_foreign_weight_version_is_refused(server):
    def other(items):
        items[2]["meta_info"]["weight_version"] = "7"

    message, err = _fault_case(server, other)
    assert err.type is SglangResponseError  # a foreign weight version is a reply that fails a check
    assert "c1-2:" in message and "'7'" in message and "expected '0'" in message


def test_malformed_base64_is_refused(server):
    def garble(items):
        meta = items[3]["meta_info"]
        meta["indexer_topk"] = corrupt_base64(meta["indexer_topk"])

    message, _ = _fault_case(server, garble)
    assert "c1-3:" in message and "'indexer_topk'" in message and "malformed base64" in message


def test_a_server_dying_mid_request_fails_over_and_loses_nothing(server, reference):
    other = serve_thread(CFG)
    proxy = FaultProxy(server.url, die_on_generate=1)
    try:
        eng = _engine(proxy.url, other.url)
        _assert_same(_generate(eng), reference)  # the whole call, resent with the same seeds
        assert proxy.generate_calls == 1  # the dead server got the request once
        assert eng.urls == [other.url, proxy.url]  # later calls go to the live server first
    finally:
        proxy.stop()
        other.stop()


def test_a_refused_request_and_no_server_are_typed_errors(server):
    eng = _engine(server.url)
    with pytest.raises(SglangRequestError, match="top_k"):  # the server's sampler refuses it
        eng.generate(_prompts(), SamplingParams(top_k=len(VOCABULARY) + 1), max_new_tokens=2,
                     eos_token_id=EOS, seed=1, traces=ALL)
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    import tempfile
    from pathlib import Path

    before = set(Path(tempfile.gettempdir()).glob("replayrl-sglang-*"))
    with pytest.raises(SglangUnavailable, match=dead):
        SglangEngine(dataclasses.asdict(CFG), urls=dead, start_timeout_s=0.5)
    # the failed start removed the weight directory it made
    assert set(Path(tempfile.gettempdir()).glob("replayrl-sglang-*")) <= before


# -- the reply checks on hand-made replies (no server) --------------------------------------

def _item(**meta) -> dict:
    """A valid reply item for prompt [3, 4] (P = 2) and response [5, EOS] (R = 2), W = 2."""
    routes = np.zeros((3, CFG.num_hidden_layers, CFG.num_experts_per_tok), np.int32)
    routes[:, :, 1] = 1
    keys = np.full((3, len(CFG.indexed_layers), CFG.index_topk), -1, np.int32)
    keys[:, :, 0] = 0
    base = {"id": "r", "finish_reason": {"type": "stop", "matched": EOS}, "prompt_tokens": 2,
            "completion_tokens": 2, "weight_version": "4",
            "output_token_logprobs": [[-0.5, 5, None], [-0.1, EOS, None]],
            "output_token_sampling_mask": [[5, 6], [EOS]],
            "output_token_sampling_logprobs": [-0.5, -0.1],
            "routed_experts": encode_int32(routes), "indexer_topk": encode_int32(keys)}
    base.update(meta)
    return {"text": "", "output_ids": [5, EOS], "meta_info": base}


def _decode(item):
    return decode_item(item, rid="r", prompt=[3, 4], config=CFG, width=2, max_new_tokens=3,
                       eos_token_id=EOS, traces=ALL, weight_version="4")


def test_a_valid_reply_decodes_to_the_design_arrays():
    g = _decode(_item())
    np.testing.assert_array_equal(g.sample_support, [[5, 5, 6], [EOS, EOS, -1]])
    np.testing.assert_array_equal(g.rollout_logprobs, np.float32([-0.5, -0.1]))
    assert g.routed_experts.shape == (3, len(CFG.moe_layers), CFG.num_experts_per_tok)
    assert (g.routed_experts[..., 1] == 1).all() and g.finish_reason == "stop"
    assert g.indexer_topk.shape == (3, len(CFG.indexed_layers), CFG.index_topk)


@pytest.mark.parametrize("change, match", [
    ({"finish_reason": {"type": "stop", "matched": 5}}, "must end with EOS"),
    ({"finish_reason": {"type": "abort", "message": "oom"}}, "aborted by the server: 'oom'"),
    ({"output_token_sampling_mask": [[6], [EOS]]}, "including the sampled 5"),
    ({"output_token_sampling_mask": [[5, 6, 7], [EOS]]}, "1..2 distinct ids"),
    ({"output_token_sampling_logprobs": [float("nan"), -0.1]}, "non-finite"),
    ({"output_token_logprobs": [[-0.5, 6, None], [-0.1, EOS, None]]}, "not the 2 output_ids"),
    ({"weight_versions": [{"version": "3", "start": 0, "end": 1},
                          {"version": "4", "start": 1, "end": 2}]}, "mixes weight versions"),
    ({"routed_experts": encode_int32(np.full((3, CFG.num_hidden_layers, 2), 8))},
     r"outside \[0, 8\)"),
    ({"indexer_topk": encode_int32(np.full((3, 2, CFG.index_topk), 2))}, "row position"),
    ({"prompt_tokens": 3}, "'prompt_tokens': 3, sent 2"),
])
def test_a_reply_that_cannot_be_a_trace_is_refused(change, match):
    with pytest.raises((SglangResponseError, SglangRequestError), match=match):
        _decode(_item(**change))


def test_serve_refuses_what_it_cannot_batch_as_one_call():
    body = generate_request(["a", "b"], [[3], [4]], PARAMS, max_new_tokens=2, eos_token_id=EOS,
                            seed=9, traces=ALL)
    batch = parse_generate_request(body)
    assert batch.seed == 9 and batch.traces == ALL and batch.prompts == ((3,), (4,))
    body["sampling_params"][1]["sampling_seed"] = 20
    with pytest.raises(ValueError, match="item 1 sampling_seed must be item 0's"):
        parse_generate_request(body)
    with pytest.raises(ValueError, match="'stream'"):
        parse_generate_request({"input_ids": [1], "stream": True})
    with pytest.raises(ValueError, match="'lora_path' is not served"):
        parse_generate_request({"input_ids": [1], "lora_path": "x"})


def test_two_concurrent_calls_one_reply_lacking_routes_names_only_that_request(server, reference):
    seen = []

    def drop_in_second_call(items):
        seen.append(items[0]["meta_info"]["id"])
        if len(seen) == 2:
            del items[1]["meta_info"]["routed_experts"]

    proxy = FaultProxy(server.url, drop_in_second_call)
    engines = [_engine(proxy.url), _engine(proxy.url)]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_generate, eng) for eng in engines]
            outcomes = [f.exception() or f.result() for f in futures]
        failed = [o for o in outcomes if isinstance(o, Exception)]
        assert len(failed) == 1 and isinstance(failed[0], SglangResponseError)
        second = seen[1].rsplit("-", 1)[0] + "-1"  # the second call's second request
        assert f"request {second}:" in str(failed[0]) and "'routed_experts'" in str(failed[0])
        _assert_same(next(o for o in outcomes if not isinstance(o, Exception)), reference)
    finally:
        for eng in engines:
            eng.close()
        proxy.stop()


def test_an_aborted_request_is_resent_and_a_persistent_abort_is_an_error(server, reference):
    calls = []

    def abort(items, always=False):
        calls.append(1)
        if always or len(calls) == 1:  # as a pause for another client's weight update does
            items[0]["meta_info"]["finish_reason"] = {"type": "abort", "message": "paused"}

    proxy = FaultProxy(server.url, abort)
    try:
        eng = _engine(proxy.url)
        _assert_same(_generate(eng), reference)
        assert len(calls) == 2
        proxy.fault = lambda items: abort(items, always=True)
        with pytest.raises(SglangUnavailable, match="aborted by the server: 'paused'"):
            _generate(eng)
        assert len(calls) == 2 + 3  # 1 + 2 retries, then the error
        eng.close()
    finally:
        proxy.stop()
