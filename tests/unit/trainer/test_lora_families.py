"""LoRA (``--lora-rank``, trainer/lora.py) on the families (rollout/model/families/:
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
import torch.distributed as dist

from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.model.families.base import FamilyModel
from replayrl.rollout.sample import Sample
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.config import build_config
from replayrl.trainer import lora
from replayrl.trainer.backends.fsdp_backend import FSDPBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batch import collate
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import TrainerConfigError
from replayrl.trainer.replay import batch_flip_rate
from replayrl.transport.array_bundle import unpack_arrays
from tests.family_checkpoints import tiny_hf_checkpoint

transformers = pytest.importorskip("transformers", reason="checkpoints are written by transformers")
pytest.importorskip("peft", reason="peft (the lora extra) is not installed")

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


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the backends set the process's threads
    if dist.is_initialized():  # the group of one the fsdp backend made in this process
        dist.destroy_process_group()


def _config(**kw) -> TrainerConfig:
    return TrainerConfig(**{"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2,
                            "lora_target_modules": TARGETS, **kw})


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _randomize_adapters(model, seed: int = 0, scale: float = 0.05) -> None:
    """Nonzero ``B`` everywhere (peft initialises it to zero), in parameter-name order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                _local(p).copy_(scale * torch.randn(p.shape, generator=g))


def _samples(model: FamilyModel) -> list[Sample]:
    """Four samples of two groups (prompts of 6 tokens: more keys than `index_topk`), traces
    the LoRA policy's own choices, support replay."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(4):
        prompt = rng.integers(3, VOCAB, 6).astype(np.int32)
        response = rng.integers(3, VOCAB, 3 + i).astype(np.int32)
        tokens = torch.from_numpy(np.r_[prompt, response][:-1].astype(np.int64))[None]
        with torch.no_grad():
            traced = model(tokens, torch.arange(tokens.shape[1])[None], capture=True)
        support = np.stack([response, response, (response + 1) % VOCAB, (response + 2) % VOCAB], axis=1)
        out.append(Sample(sample_id=i, group_id=i // 2, rollout_id=0, policy_version=0,
                          prompt_ids=prompt, response_ids=response,
                          loss_mask=np.ones(len(response), np.uint8),
                          rollout_logprobs=np.full(len(response), -1.0, np.float32),
                          sample_support=support,
                          routed_experts=traced.routed_experts[0].numpy().astype(np.int32),
                          indexer_topk=None if traced.indexer_topk is None
                          else traced.indexer_topk[0].numpy().astype(np.int32)))
    return out


def _batch(backend):
    indexer = bool(backend.model_config.indexed_layers)
    return collate(_samples(backend.model), routing=True, indexer=indexer, support=True)


def _loss(logp: torch.Tensor) -> torch.Tensor:
    return -(logp * torch.linspace(-1.0, 1.0, len(logp))).sum()


def _step(backend, batch) -> float:
    backend.zero_grad()
    backend.forward_backward(batch, _loss)
    return backend.clip_and_step(1.0)


def _plain(state: dict, cfg) -> FamilyModel:
    with torch.random.fork_rng(devices=[]):
        model = FamilyModel.from_config(cfg, torch.float32)
    model.load_state_dict(state)
    return model.eval()


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (3, 11), generator=g), torch.arange(11).expand(3, 11)


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
    by_hand = sum(4 * (m.in_features + m.out_features) for name, m in plain.named_modules()
                  if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ATTENTION)
    assert sum(params[n].numel() for n in names if ".self_attn." in n) == by_hand
    # the fused expert tensors are adapted (peft's ParamWrapper), per expert; peft 0.21 does
    # not map gpt-oss's (fused with biases): there only attention is adapted
    experts = {n: w for n, w in lora.adapted_weights(backend.model).items() if ".mlp.experts." in n}
    assert {n.rsplit(".", 1)[-1] for n in experts} == (set() if family == "gpt_oss" else {"gate_up_proj", "down_proj"})
    base = {k: v.clone() for k, v in lora.base_state(backend.model).items()}
    adapters = {n: p.detach().clone() for n, p in backend.model.named_parameters() if ".lora_" in n}
    assert np.isfinite(_step(backend, _batch(backend)))
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
    _randomize_adapters(backend.model)
    backend.save_hf(tmp_path / "merged")
    plain = TorchBackend(str(tmp_path / "merged"), TrainerConfig(), [])
    batch = _batch(backend)
    got, want = backend.preflight_logprobs(batch), plain.preflight_logprobs(batch)
    traced = (batch.routed_experts >= 0).all(-1)
    assert int(traced.sum()) > 0
    assert torch.equal(got.routed_experts[traced], batch.routed_experts[traced].to(torch.int32))
    real = batch.key_padding_mask
    # the step's metrics (trainer/rank_step.py): flips 0, and the router's own choices drift
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


def test_the_embedded_engine_merges_a_family_adapter_push(checkpoints):
    backend = TorchBackend(str(checkpoints["glm_moe_dsa"]), _config(), [])
    cfg = backend.model_config
    engine = EmbeddedEngine(dataclasses.asdict(cfg), dtype=torch.float32)
    engine.load_weights(unpack_arrays(backend.weight_bundle(full=True)), version=0)
    ids, pos = _ids()
    batch = _batch(backend)
    for version in (1, 2):  # twice: the engine merges into the base it kept
        _randomize_adapters(backend.model, seed=version)
        _step(backend, batch)
        arrays = unpack_arrays(backend.weight_bundle(full=False))
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
    _randomize_adapters(backend.model)
    _step(backend, _batch(backend))
    backend.save_checkpoint(tmp_path / "ckpt", 4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model",
                                                           attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "ckpt" / "adapter").eval()
    ids, _ = _ids()
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
    _randomize_adapters(reference.model)
    _randomize_adapters(fsdp.model)
    batch = _batch(reference)
    want, got = reference.preflight_logprobs(batch), fsdp.preflight_logprobs(batch)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    for field in ("routed_experts", "own_routed_experts", "indexer_topk", "own_indexer_topk"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    norms = [_step(b, batch) for b in (reference, fsdp)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    for full in (True, False):
        pushed, expected = fsdp.push_arrays(full=full), unpack_arrays(reference.weight_bundle(full=full))
        assert list(pushed) == list(expected)
        for name, array in expected.items():
            np.testing.assert_allclose(pushed[name], array, rtol=0, atol=1e-5, err_msg=name)
    merged, expected = fsdp.weights(), reference.weights()
    assert set(merged) == set(expected)
    for name, array in expected.items():
        np.testing.assert_allclose(merged[name], array, rtol=0, atol=1e-5, err_msg=name)


def test_what_cannot_run_on_a_family_is_refused_naming_the_field(checkpoints, tmp_path):
    small = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "lora-rank": 8,
             "hf-checkpoint": str(checkpoints["glm_moe_dsa"]), "output-dir": str(tmp_path)}
    assert build_config(small).trainer.lora_rank == 8
    assert build_config({**small, "train-backend": "fsdp"}).trainer.train_backend == "fsdp"
    with pytest.raises(ConfigError, match=r"--lora-target-modules gate with the 'glm_moe_dsa' family"):
        build_config({**small, "lora-target-modules": "gate,o_proj"})
    with pytest.raises(ConfigError, match=r"--lora-target-modules kv_b_proj: MLA projections"):
        build_config({"lora-rank": 8, "lora-target-modules": "o_proj,kv_b_proj"})
    with pytest.raises(TrainerConfigError, match="--lora-target-modules gate"):
        TorchBackend(str(checkpoints["glm_moe_dsa"]), _config(lora_target_modules="gate"), [])
