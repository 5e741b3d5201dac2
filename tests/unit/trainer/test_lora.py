"""LoRA through peft (``--lora-rank``, trainer/lora/peft_adapter.py) on the torch backend: only the adapters
train and sit in the optimizer, base weights stay bit-identical; an expert's adapter changes
that expert's output; the push after the first carries only the adapters and the embedded
engine that merges them computes the trainer's merged policy; a checkpoint holds the adapters,
loads into ``peft.PeftModel`` over the base transformers reads, and round-trips; an adapted LM
head reads as ``W + (alpha / r) B A`` on the full-logits and the fused support-replay paths and
reaches the engine, and a head tied to the embedding is refused; what cannot run is refused
before start."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from replayrl.rollout.engines.embedded import EmbeddedEngine
from replayrl.rollout.model import Qwen3MoeForCausalLM
from replayrl.rollout.model.loader import load_pretrained
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.rollout.weight_sync.zmq import ZmqSync
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import TrainerConfigError
from replayrl.trainer.lora import peft_adapter as lora
from replayrl.trainer.lora.run_check import check_run
from replayrl.transport.array_bundle import unpack_arrays
from tests.backend_fixtures import (
    DEFAULT_TARGETS,
    adapter_size_by_hand,
    decisive_checkpoint,
    lora_config,
    randomize_adapters,
    token_ids,
    traced_samples,
    train_step,
)

pytest.importorskip("peft", reason="peft (the lora extra) is not installed")

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The embedded default policy without the indexer (transformers has none), decisive
    routing (no near ties between the two implementations)."""
    cfg = build_config({"model-indexer": False}).policy_config
    return decisive_checkpoint(tmp_path_factory.mktemp("init") / "model", cfg, seed=3)


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the backends set the process's threads


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """As :func:`checkpoint` with every layer MoE: peft 0.21, loading an adapter into
    transformers 5's fused experts, maps every ``gate_proj`` / ``up_proj`` / ``down_proj``
    target to the experts and drops a dense layer's MLP adapters (docs/design/lora.md#lora)."""
    cfg = dataclasses.replace(build_config({"model-indexer": False}).policy_config, mlp_only_layers=())
    return decisive_checkpoint(tmp_path_factory.mktemp("init-moe") / "model", cfg, seed=3)


def _step(backend: TorchBackend) -> None:
    batch = collate(traced_samples(backend.model, len(VOCABULARY), adapted=True), routing=True,
                    indexer=bool(backend.model_config.index_layers), support=True)
    assert np.isfinite(train_step(backend, batch))


def _adapter_size_by_hand(checkpoint, rank: int, targets) -> int:
    """r x (in + out) for every nn.Linear of the plain policy whose name ends with a target."""
    return adapter_size_by_hand(load_pretrained(checkpoint)[0], rank, targets)


def _plain(state: dict, cfg) -> Qwen3MoeForCausalLM:
    model = Qwen3MoeForCausalLM.empty(cfg, torch.float32)
    model.load_state_dict(state)
    return model.eval()


def test_only_the_adapters_train_and_sit_in_the_optimizer(checkpoint):
    backend = TorchBackend(str(checkpoint), lora_config(), list(VOCABULARY))
    want = _adapter_size_by_hand(checkpoint, 4, DEFAULT_TARGETS)
    in_optimizer = sum(p.numel() for g in backend.optimizer.param_groups for p in g["params"])
    trainable = sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    assert in_optimizer == trainable == want > 0
    # the router is not adapted unless named; every expert projection is
    names = {n for n, _ in backend.model.named_parameters() if ".lora_A." in n}
    assert not any(".mlp.gate.lora" in n for n in names)
    assert "model.layers.1.mlp.experts.7.down_proj.lora_A.default.weight" in names
    base = {k: v.clone() for k, v in lora.base_state(backend.model).items()}
    adapters = {n: p.detach().clone() for n, p in backend.model.named_parameters() if ".lora_" in n}
    _step(backend)
    for name, t in lora.base_state(backend.model).items():
        assert torch.equal(t, base[name]), name  # bit-identical
    moved = [n for n, p in backend.model.named_parameters() if ".lora_" in n and not torch.equal(p, adapters[n])]
    assert any(".experts." in n for n in moved) and any("self_attn" in n for n in moved)


def test_the_router_is_adapted_when_named(checkpoint):
    backend = TorchBackend(str(checkpoint), lora_config(lora_target_modules="gate,q_proj"), list(VOCABULARY))
    names = [n for n, _ in backend.model.named_parameters() if ".lora_A." in n]
    assert {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in names} == {"gate", "q_proj"}
    assert sum(p.numel() for p in backend.params) == _adapter_size_by_hand(checkpoint, 4, ("gate", "q_proj"))


def test_an_expert_adapter_changes_that_experts_output(checkpoint):
    model, cfg = load_pretrained(checkpoint)
    lora.add_adapters(model, 4, 8.0, ("down_proj",), seed=0)
    moe = model.model.layers[1].mlp
    layer = moe.experts[2].down_proj
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=g))
    x = torch.randn(1, 9, cfg.hidden_size, generator=g)
    with torch.no_grad():
        base_out, experts, _ = moe(x, None)  # outside the block: the base weights
        with lora.experts_adapted(model):
            out, same, _ = moe(x, None)
    assert torch.equal(same, experts)
    # by hand: expert 2's output gains routing_weight x (2 * B @ A) @ h, h its hidden activation
    probs = torch.softmax(x[0] @ moe.gate.weight.T, -1)
    top = torch.topk(probs, cfg.num_experts_per_tok, -1)
    w = top.values / top.values.sum(-1, keepdim=True)
    e2 = moe.experts[2]
    hidden = torch.nn.functional.silu(x[0] @ e2.gate_proj.weight.T) * (x[0] @ e2.up_proj.weight.T)
    delta = 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight  # alpha / r = 2
    gain = ((top.indices == 2) * w).sum(-1, keepdim=True) * (hidden @ delta.T)
    assert bool((top.indices == 2).any()) and gain.abs().max() > 1e-3
    torch.testing.assert_close(out[0] - base_out[0], gain, rtol=0, atol=1e-5)
    # and it trains: the gradient reaches the expert's factors through the grouped matmul
    with lora.experts_adapted(model):
        moe(x, None)[0].square().sum().backward()
    assert layer.lora_A["default"].weight.grad.abs().max() > 0


def test_the_push_after_the_first_carries_only_adapters_and_the_engine_merges_them(checkpoint):
    backend = TorchBackend(str(checkpoint), lora_config(), list(VOCABULARY))
    cfg = backend.model_config
    engine = EmbeddedEngine(dataclasses.asdict(cfg), dtype=torch.float32)
    full = ZmqSync().pack(backend.push_tensors(full=True), version=0).payload  # as a run sends it
    engine.load_weights(unpack_arrays(full), version=0)
    ids, pos = token_ids(cfg.vocab_size)
    for version in (1, 2):  # twice: the engine merges into the base it kept, not the last merge
        randomize_adapters(backend.model, seed=version)
        _step(backend)
        bundle = ZmqSync().pack(backend.push_tensors(full=False), version=version).payload
        arrays = unpack_arrays(bundle)
        assert arrays and all(k.endswith((".lora_A", ".lora_B")) for k in arrays)
        n_adapter = sum(p.numel() for p in backend.params)
        assert sum(b.nbytes for b in bundle["buffers"]) == 4 * n_adapter
        assert sum(b.nbytes for b in full["buffers"]) > 10 * 4 * n_adapter
        engine.load_weights(arrays, version=version)
        trainer_merged = _plain(lora.merged_state(backend.model), cfg)
        with torch.no_grad():
            want = trainer_merged(ids, pos).logits
            got = engine.model(ids, pos).logits
            with lora.experts_adapted(backend.model):  # the LoRA policy's own forward
                own = backend.model(ids, pos).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(own, want, rtol=0, atol=1e-5)
    base = _plain({k: v for k, v in lora.base_state(backend.model).items()}, cfg)
    with torch.no_grad():
        assert (base(ids, pos).logits - want).abs().max() > 1e-3  # the adapters do something


def test_a_checkpoint_holds_the_adapters_and_loads_into_peft(moe_checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    from peft import PeftModel

    checkpoint = moe_checkpoint
    backend = TorchBackend(str(checkpoint), lora_config(), list(VOCABULARY))
    randomize_adapters(backend.model)
    _step(backend)
    backend.save_checkpoint(tmp_path / "ckpt", 5)
    assert {p.name for p in (tmp_path / "ckpt" / "adapter").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors"}
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ckpt" / "model",
                                                          attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "ckpt" / "adapter").eval()
    ids, pos = token_ids(backend.model_config.vocab_size)
    with torch.no_grad(), lora.experts_adapted(backend.model):
        ours = backend.model(ids, pos).logits
        theirs = peft_model(input_ids=ids, position_ids=pos).logits
        with peft_model.disable_adapter():
            base = peft_model(input_ids=ids, position_ids=pos).logits
    assert (base - ours).abs().max() > 1e-3  # the adapters were loaded and do something
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    # round trip: a fresh LoRA backend restores weights and optimizer bit for bit
    assert TorchBackend.check_checkpoint(tmp_path / "ckpt", lora_config()) == 5
    again = TorchBackend(str(checkpoint), lora_config(), list(VOCABULARY))
    assert again.load_checkpoint(tmp_path / "ckpt") == 5
    assert again.digest() == backend.digest()
    with pytest.raises(ValueError, match="lora_alpha"):
        TorchBackend.check_checkpoint(tmp_path / "ckpt", lora_config(lora_alpha=4.0))


def test_routing_and_indexer_replay_are_unchanged_under_lora(tmp_path):
    """The embedded default with its indexer: on the same replayed batch, the LoRA policy's
    preflight uses the experts and keys, and gives the own choices and logprobs, of a plain
    (no-LoRA) backend holding its merged weights."""
    cfg = build_config({}).policy_config
    assert cfg.index_layers  # the indexer is on
    checkpoint = decisive_checkpoint(tmp_path / "init", cfg, seed=4)
    backend = TorchBackend(str(checkpoint), lora_config(), list(VOCABULARY))
    randomize_adapters(backend.model)
    backend.save_hf(tmp_path / "merged")
    plain = TorchBackend(str(tmp_path / "merged"), TrainerConfig(), list(VOCABULARY))
    batch = collate(traced_samples(backend.model, len(VOCABULARY), adapted=True), routing=True, indexer=True,
                    support=True)
    got, want = backend.preflight_logprobs(batch), plain.preflight_logprobs(batch)
    for field in ("routed_experts", "own_routed_experts", "indexer_topk"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    # the indexer's own top-k over keys of near-equal scores may flip on a float rounding
    # (adapters applied in activation space vs merged into the weights): a few slots at most
    assert (got.own_indexer_topk != want.own_indexer_topk).float().mean() < 0.02
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)


def test_what_cannot_run_is_refused_before_start():
    with pytest.raises(TrainerConfigError, match="--train-backend torch"):
        TrainerConfig(lora_rank=8, train_backend="megatron")
    with pytest.raises(TrainerConfigError, match="'mlp'"):
        TrainerConfig(lora_rank=8, lora_target_modules="q_proj,mlp")
    with pytest.raises(ConfigError, match="--rollout-engine vllm"):
        build_config({"lora-rank": 8, "rollout-engine": "vllm", "model-indexer": False})
    assert build_config({"lora-rank": 8}).trainer.lora_rank == 8
    assert TrainerConfig().lora_rank == 0  # off by default


HEAD_TARGETS = "q_proj,lm_head"


def test_the_adapted_head_multiplies_by_its_merged_weight_on_both_paths(checkpoint):
    backends = [TorchBackend(str(checkpoint), lora_config(lora_target_modules=HEAD_TARGETS, logprobs_chunk_size=c),
                             list(VOCABULARY)) for c in (0, 5)]
    for backend in backends:
        randomize_adapters(backend.model, seed=7, scale=0.5)
    head = backends[0].model.lm_head
    by_hand = head.base_layer.weight + 2.0 * head.lora_B["default"].weight @ head.lora_A["default"].weight
    torch.testing.assert_close(lora.head_weight(head), by_hand, rtol=0, atol=1e-6)
    assert (by_hand - head.base_layer.weight).abs().max() > 0.1  # the adapter moves the head
    batch = collate(traced_samples(backends[0].model, len(VOCABULARY), adapted=True), routing=True,
                    indexer=False, support=True)
    full, fused = (b.preflight_logprobs(batch).logprobs for b in backends)
    torch.testing.assert_close(fused, full, rtol=0, atol=1e-5)  # chunked path = peft's forward


def test_the_engine_merges_the_head_adapter_into_the_trainers_policy(checkpoint):
    backend = TorchBackend(str(checkpoint), lora_config(lora_target_modules=HEAD_TARGETS), list(VOCABULARY))
    cfg = backend.model_config
    engine = EmbeddedEngine(dataclasses.asdict(cfg), dtype=torch.float32)
    engine.load_weights({k: t.numpy() for k, t in backend.push_tensors(full=True).items()}, version=0)
    randomize_adapters(backend.model, seed=3, scale=0.5)
    push = backend.push_tensors(full=False)
    assert {"lm_head.weight.lora_A", "lm_head.weight.lora_B"} <= set(push)
    engine.load_weights({k: t.numpy() for k, t in push.items()}, version=1)
    ids, pos = token_ids(cfg.vocab_size)
    with torch.no_grad():
        got = engine.model(ids, pos).logits
        with lora.experts_adapted(backend.model):
            want = backend.model(ids, pos).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    embeddings = (m.model.embed_tokens.weight.detach().numpy() for m in (engine.model, backend.model))
    np.testing.assert_array_equal(*embeddings)  # the embedding is untouched by the head's adapter


def test_a_head_tied_to_the_embedding_is_refused_before_start():
    run = build_config({"lora-rank": 8, "lora-target-modules": HEAD_TARGETS})
    check_run(run)  # the embedded default's head is untied
    tied = SimpleNamespace(trainer=run.trainer, hf_checkpoint=None,
                           policy_config=dataclasses.replace(run.policy_config, tie_word_embeddings=True))
    with pytest.raises(TrainerConfigError, match="tie_word_embeddings"):
        check_run(tied)
