"""LoRA (``--lora-rank``, trainer/lora/peft_adapter.py) on the families (rollout/model/families/:
transformers' model with our router / indexer hooks): peft adapts the attention projections and,
through its ``ParamWrapper``, the fused expert tensors; the router and the indexer are not
adapted, and routing / indexer replay is unchanged under LoRA (the replayed choices are used,
flips 0, the LoRA policy's logprobs are those of its merged weights); the embedded engine merges
the adapter push (per-expert factors included); a checkpoint's adapter loads into
``peft.PeftModel`` over the base transformers reads; the fsdp backend's LoRA step equals the
torch backend's; what cannot run is refused before start, naming the field."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.model.families.base import FamilyModel
from replayrl.rollout.weight_sync.zmq import ZmqSync
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.trainer.backends.fsdp_backend import FSDPBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import TrainerConfigError
from replayrl.trainer.lora import peft_adapter as lora
from replayrl.trainer.replay.checks import batch_flip_rate
from replayrl.transport.array_bundle import unpack_arrays
from tests.backend_fixtures import (
    adapter_size_by_hand,
    assert_fsdp_takes_the_torch_step,
    assert_same_arrays,
    assert_same_push,
    lora_config,
    randomize_adapters,
    token_ids,
    traced_samples,
    train_step,
)
from tests.family_checkpoints import tiny_hf_checkpoint

transformers = pytest.importorskip("transformers", reason="checkpoints are written by transformers")
pytest.importorskip("peft", reason="peft (the lora extra) is not installed")
pytestmark = pytest.mark.usefixtures("one_rank_group")

VOCAB = 97  # tests/family_checkpoints.py
TARGETS = "q_proj,k_proj,v_proj,o_proj,q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,gate_proj,up_proj,down_proj"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
FAMILIES = ("glm_moe_dsa", "deepseek_v32", "glm4_moe_lite", "gpt_oss")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        out[family] = tmp_path_factory.mktemp(family) / "ckpt"
        tiny_hf_checkpoint(family, out[family])
    return out


def _config(**kw) -> TrainerConfig:
    return lora_config(**{"lora_target_modules": TARGETS, **kw})


def _batch(backend):
    indexer = bool(backend.model_config.indexed_layers)
    return collate(traced_samples(backend.model, VOCAB, prompt_len=6), routing=True, indexer=indexer,
                   support=True)


def _plain(state: dict, cfg) -> FamilyModel:
    with torch.random.fork_rng(devices=[]):
        model = FamilyModel.from_config(cfg, torch.float32)
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_only_adapters_train_and_the_router_and_indexer_are_not_adapted(checkpoints, family):
    backend = TorchBackend(str(checkpoints[family]), _config(), [])
    params = dict(backend.model.hf.named_parameters())
    names = [n for n, p in params.items() if p.requires_grad]
    assert names and all(".lora_" in n for n in names)
    in_optimizer = sum(p.numel() for g in backend.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(params[n].numel() for n in names)
    assert not any(".mlp.gate." in n or ".indexer." in n for n in names)
    # every MLA projection and o_proj: r x (in + out), by hand over transformers' nn.Linear
    plain = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[family])
    by_hand = adapter_size_by_hand(plain, 4, ATTENTION)
    assert sum(params[n].numel() for n in names if ".self_attn." in n) == by_hand
    # the fused expert tensors are adapted (peft's ParamWrapper), per expert; peft 0.21 does
    # not map gpt-oss's (fused with biases): there only attention is adapted
    experts = {n: w for n, w in lora.adapted_weights(backend.model).items() if ".mlp.experts." in n}
    assert {n.rsplit(".", 1)[-1] for n in experts} == (set() if family == "gpt_oss" else {"gate_up_proj", "down_proj"})
    base = {k: v.clone() for k, v in lora.base_state(backend.model).items()}
    adapters = {n: p.detach().clone() for n, p in backend.model.named_parameters() if ".lora_" in n}
    assert np.isfinite(train_step(backend, _batch(backend)))
    for name, t in lora.base_state(backend.model).items():
        assert torch.equal(t, base[name]), name  # bit-identical
    moved = [n for n, p in backend.model.named_parameters() if ".lora_" in n and not torch.equal(p, adapters[n])]
    assert any(".self_attn." in n for n in moved)
    assert any(".mlp.experts." in n for n in moved) == (family != "gpt_oss")


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_and_indexer_replay_are_unchanged_under_lora(checkpoints, family, tmp_path):
    """On the same replayed batch (traces = the LoRA policy's own choices), the LoRA policy's
    preflight uses the replayed experts and keys, its own choices are those (flips 0), and it
    gives the choices and logprobs of a plain backend holding its merged weights."""
    backend = TorchBackend(str(checkpoints[family]), _config(), [])
    randomize_adapters(backend.model)
    backend.save_hf(tmp_path / "merged")
    plain = TorchBackend(str(tmp_path / "merged"), TrainerConfig(), [])
    batch = _batch(backend)
    got, want = backend.preflight_logprobs(batch), plain.preflight_logprobs(batch)
    traced = (batch.routed_experts >= 0).all(-1)
    assert int(traced.sum()) > 0
    assert torch.equal(got.routed_experts[traced], batch.routed_experts[traced].to(torch.int32))
    real = batch.key_padding_mask
    # the step's metrics (trainer/ranks/rank_step.py): flips 0, and the router's own choices drift
    # from the trace no more than the plain policy's do
    assert batch_flip_rate(batch.routed_experts, got.routed_experts, real) == 0.0
    assert batch_flip_rate(batch.routed_experts, got.own_routed_experts, real) == \
        batch_flip_rate(batch.routed_experts, want.own_routed_experts, real)
    fields = ["routed_experts", "own_routed_experts"]
    if batch.indexer_topk is not None:
        assert int((batch.indexer_topk >= 0).sum()) > 0
        assert batch_flip_rate(batch.indexer_topk, got.indexer_topk, real) == 0.0
        # the indexer's own top-k over keys of near-equal scores may flip on a float rounding
        # (adapters applied in activation space vs merged into the weights): a few rows at most
        drift = [batch_flip_rate(batch.indexer_topk, x.own_indexer_topk, real) for x in (got, want)]
        assert abs(drift[0] - drift[1]) < 0.02
        fields += ["indexer_topk"]
    for field in fields:
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    unadapted = TorchBackend(str(checkpoints[family]), TrainerConfig(), []).preflight_logprobs(batch)
    assert (unadapted.logprobs - got.logprobs).abs().max() > 1e-3  # the adapters do something


def _bundle(backend: TorchBackend, full: bool) -> dict:
    """The push as a run sends it (the zmq sync's bundle of ``push_tensors``)."""
    return ZmqSync().pack(backend.push_tensors(full=full), version=0).payload


def test_the_embedded_engine_merges_a_family_adapter_push(checkpoints):
    backend = TorchBackend(str(checkpoints["glm_moe_dsa"]), _config(), [])
    cfg = backend.model_config
    engine = EmbeddedEngine(dataclasses.asdict(cfg), dtype=torch.float32)
    engine.load_weights(unpack_arrays(_bundle(backend, full=True)), version=0)
    ids, pos = token_ids(VOCAB)
    batch = _batch(backend)
    for version in (1, 2):  # twice: the engine merges into the base it kept
        randomize_adapters(backend.model, seed=version)
        train_step(backend, batch)
        arrays = unpack_arrays(_bundle(backend, full=False))
        assert arrays and all(k.endswith((".lora_A", ".lora_B")) for k in arrays)
        expert = "model.layers.1.mlp.experts.down_proj"  # [E, out, in]: per-expert factors
        assert arrays[expert + ".lora_A"].ndim == arrays[expert + ".lora_B"].ndim == 3
        engine.load_weights(arrays, version=version)
        with torch.no_grad():
            want = _plain(lora.merged_state(backend.model), cfg)(ids, pos).logits
            got = engine.model(ids, pos).logits
            own = backend.model.eval()(ids, pos).logits  # peft's own forward of the LoRA policy
        backend.model.train()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(own, want, rtol=0, atol=1e-5)
    # by hand: expert 3's merged down_proj is its base plus scaling x B_e @ A_e of peft's factors
    layer = dict(lora._lora_layers(backend.model))["model.layers.1.mlp.experts"]
    e, r = layer.num_experts, layer.r["default"]
    a = layer.lora_A["default"].weight.detach().reshape(e, r, -1)[3]
    b = layer.lora_B["default"].weight.detach().reshape(-1, r, e)[:, :, 3]
    delta = layer.scaling["default"] * b @ a
    merged, base = lora.merged_state(backend.model), lora.base_state(backend.model)
    torch.testing.assert_close(merged[expert][3] - base[expert][3], delta, rtol=0, atol=1e-6)


def test_a_family_lora_checkpoint_loads_into_peft_and_round_trips(checkpoints, tmp_path):
    from peft import PeftModel

    backend = TorchBackend(str(checkpoints["glm_moe_dsa"]), _config(), [])
    randomize_adapters(backend.model)
    train_step(backend, _batch(backend))
    backend.save_checkpoint(tmp_path / "ckpt", 4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model",
                                                           attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "ckpt" / "adapter").eval()
    ids, _ = token_ids(VOCAB)
    with torch.no_grad():
        ours = backend.model.eval()(ids, torch.arange(11).expand(3, 11)).logits
        theirs = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            base = peft_model(input_ids=ids).logits
    assert (base - ours).abs().max() > 1e-3  # the adapters were loaded and do something
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    assert TorchBackend.check_checkpoint(tmp_path / "ckpt", _config()) == 4
    again = TorchBackend(str(checkpoints["glm_moe_dsa"]), _config(), [])
    assert again.load_checkpoint(tmp_path / "ckpt") == 4
    assert again.digest() == backend.digest()


def test_a_family_lora_step_on_fsdp_equals_the_torch_backends(checkpoints):
    path = str(checkpoints["glm_moe_dsa"])
    reference = TorchBackend(path, _config(), [])
    fsdp = FSDPBackend(path, _config(train_backend="fsdp"), [])
    randomize_adapters(reference.model)
    randomize_adapters(fsdp.model)
    assert_fsdp_takes_the_torch_step(reference, fsdp, _batch(reference), atol=1e-5, rel=1e-5)
    assert_same_push(reference, fsdp, atol=1e-5)
    assert_same_arrays(fsdp.weights(), reference.weights(), atol=1e-5)


def test_what_cannot_run_on_a_family_is_refused_naming_the_field(checkpoints, tmp_path):
    small = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "lora-rank": 8,
             "hf-checkpoint": str(checkpoints["glm_moe_dsa"]), "output-dir": str(tmp_path)}
    assert build_config(small).trainer.lora_rank == 8
    assert build_config({**small, "train-backend": "fsdp"}).trainer.train_backend == "fsdp"
    with pytest.raises(ConfigError, match=r"--lora-target-modules gate with the 'glm_moe_dsa' family"):
        build_config({**small, "lora-target-modules": "gate,o_proj"})
    with pytest.raises(ConfigError, match=r"--lora-target-modules kv_b_proj: projections of the --hf-checkpoint"):
        build_config({"lora-rank": 8, "lora-target-modules": "o_proj,kv_b_proj"})
    with pytest.raises(TrainerConfigError, match="--lora-target-modules gate"):
        TorchBackend(str(checkpoints["glm_moe_dsa"]), _config(lora_target_modules="gate"), [])
