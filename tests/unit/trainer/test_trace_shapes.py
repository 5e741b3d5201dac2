"""A trace whose per-token shape is not the model's (more or fewer layer columns than the
model's MoE / indexed layers, another top-k width) is refused before any forward, and every
such error names the sample and the field: the trainer's forward (torch backend, replay on and
off, padded and packed batches) and the SGLang reply decoder (where the sample is the request).

The model's shape is worked out by hand from ``default_config``: MoE layers = every layer but
``mlp_only_layers`` (when ``num_experts > 0``), indexed layers = ``index_layers``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.engines.sglang_protocol import decode_item, encode_int32
from replayrl.rollout.model.config import default_config
from replayrl.rollout.sample import Sample
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.ranks.trainer_actor import TrainerActor

CFG = default_config(len(VOCABULARY))
# by hand from the config: 4 layers, layer 0 dense -> MoE layers 1, 2, 3 with top-2 routing;
# indexer on layers 1 and 3 keeping 8 keys
MOE_LAYERS, TOP_K = 4 - len(CFG.mlp_only_layers), CFG.num_experts_per_tok
INDEXED, INDEX_K = len(CFG.index_layers), CFG.index_topk
KINDS = ("more layers", "fewer layers", "wider", "narrower")
FIELDS = ("routed_experts", "indexer_topk")


def _reshape(trace: np.ndarray, kind: str) -> np.ndarray:
    """``trace`` [T, L, K] with one layer column more / less, or one top-k slot more / less
    (the added entries copy the first column / slot, so the values stay valid)."""
    if kind == "more layers":
        return np.concatenate([trace, trace[:, :1]], axis=1)
    if kind == "fewer layers":
        return trace[:, :-1]
    if kind == "wider":
        return np.concatenate([trace, trace[..., :1]], axis=2)
    return trace[..., :-1]


def _traces(rows: int) -> dict[str, np.ndarray]:
    """Valid traces of the model's shape: experts 0 and 1 everywhere, key 0 in every row."""
    routed = np.tile(np.arange(TOP_K, dtype=np.int32), (rows, MOE_LAYERS, 1))
    keys = np.full((rows, INDEXED, INDEX_K), -1, np.int32)
    keys[:, :, 0] = 0
    return {"routed_experts": routed, "indexer_topk": keys}


def _sample(sample_id: int, **traces) -> Sample:
    prompt, response = np.array([1, 10, 20, 30], np.int32), np.array([5, 6, 7], np.int32)
    return Sample(sample_id=sample_id, group_id=0, rollout_id=0, policy_version=0,
                  prompt_ids=prompt, response_ids=response, loss_mask=np.ones(3, np.uint8),
                  rollout_logprobs=np.zeros(3, np.float32),
                  sample_support=np.stack([response, response], axis=1), **traces)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_initial_checkpoint(build_config({}), tmp_path_factory.mktemp("ckpt")))


@pytest.fixture
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the trainer backend sets the process's threads


SETTINGS = {"replay on": {}, "replay off": {"use_routing_replay": False, "use_indexer_replay": False},
            "packed": {"use_packing": True}}


def test_the_model_shape_by_hand_is_the_configs():
    assert (MOE_LAYERS, TOP_K, INDEXED, INDEX_K) == (len(CFG.moe_layers), 2, len(CFG.indexed_layers), 8)


ORDERS = {"alone": ("bad",), "first": ("bad", "good"), "second": ("good", "bad")}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field", FIELDS)
def test_trainer_refuses_a_trace_of_another_shape_naming_sample_and_field(
        checkpoint, _restore_threads, order, setting, kind, field):
    actor = TrainerActor(checkpoint, TrainerConfig(**SETTINGS[setting]).to_dict(),
                         n_samples_per_prompt=2, engines=[], rollout_batch_size=1,
                         vocab_tokens=list(VOCABULARY))
    assert actor.backend.model_config == CFG
    good = _traces(6)
    samples = {"good": _sample(11, **good),
               "bad": _sample(12, **{**good, field: _reshape(good[field], kind)})}
    with pytest.raises(Exception) as info:
        actor.preflight([samples[name] for name in ORDERS[order]])
    message = str(info.value)
    assert f"sample 12: field {field!r}" in message, message
    assert actor.cache.peak_bytes == 0  # refused before any forward


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field", FIELDS)
def test_sglang_decoder_refuses_a_trace_of_another_shape_naming_request_and_field(kind, field):
    eos = VOCABULARY.index("<eos>")
    routes = np.tile(np.arange(TOP_K, dtype=np.int32), (3, CFG.num_hidden_layers, 1))  # all layers
    traces = {"routed_experts": routes, "indexer_topk": _traces(3)["indexer_topk"]}
    traces[field] = _reshape(traces[field], kind)
    meta = {"id": "req-7", "finish_reason": {"type": "stop", "matched": eos}, "prompt_tokens": 2,
            "completion_tokens": 2, "weight_version": "4",
            "output_token_logprobs": [[-0.5, 5, None], [-0.1, eos, None]],
            "output_token_sampling_mask": [[5, 6], [eos]],
            "output_token_sampling_logprobs": [-0.5, -0.1],
            **{name: encode_int32(value) for name, value in traces.items()}}
    with pytest.raises(Exception) as info:
        decode_item({"text": "", "output_ids": [5, eos], "meta_info": meta}, rid="req-7",
                    prompt=[3, 4], config=CFG, width=2, max_new_tokens=3, eos_token_id=eos,
                    traces=frozenset({"sample_support", *FIELDS}), weight_version="4")
    message = str(info.value)
    assert "request req-7" in message and repr(field) in message, message
