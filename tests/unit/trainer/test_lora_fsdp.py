"""LoRA (``--lora-rank``, trainer/lora.py) on --train-backend fsdp in one process (a
world-size-1 gloo group): adapters added before ``fully_shard``, only they train and sit in the
optimizer; one step equals the torch backend's LoRA step (same seed: same adapter init), with
expert adapters and replayed routing / indexer choices; the push gathered from the shards is the
torch backend's LoRA bundle (base + adapters first, adapters only after); the checkpoint holds
the base and peft's adapter files as the torch backend's does, and round-trips."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist

from replayrl.rollout.model.checkpoint import save_pretrained
from replayrl.rollout.sample import Sample
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.config import build_config
from replayrl.trainer import lora
from replayrl.trainer.backends.fsdp_backend import FSDPBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batch import collate
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import TrainerConfigError
from replayrl.transport.array_bundle import unpack_arrays
from tests.model_helpers import decisive_model

pytest.importorskip("peft", reason="peft (the lora extra) is not installed")

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The embedded default policy with its DSA indexer, decisive routing."""
    cfg = build_config({}).policy_config
    assert cfg.index_layers
    directory = tmp_path_factory.mktemp("init") / "model"
    save_pretrained(decisive_model(cfg, seed=4, norm_jitter=0.2), directory, tokens=list(VOCABULARY))
    return directory


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the backends set the process's threads
    if dist.is_initialized():  # the group of one the fsdp backend made in this process
        dist.destroy_process_group()


def _config(**kw) -> TrainerConfig:
    return TrainerConfig(**{"lora_rank": 4, "lora_alpha": 8.0, "lr": 1e-2, **kw})


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _randomize_adapters(model, seed: int = 0, scale: float = 0.05) -> None:
    """Nonzero ``B`` everywhere, drawn in parameter-name order (one rank: the shard is all)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                _local(p).copy_(scale * torch.randn(p.shape, generator=g))


def _samples(model) -> list[Sample]:
    """Four samples of two groups, routing / indexer traces the LoRA policy's own choices,
    support replay."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(4):
        prompt = rng.integers(3, len(VOCABULARY), 5).astype(np.int32)
        response = rng.integers(3, len(VOCABULARY), 3 + i).astype(np.int32)
        tokens = torch.from_numpy(np.r_[prompt, response][:-1].astype(np.int64))[None]
        with torch.no_grad(), lora.experts_adapted(model):
            traced = model(tokens, torch.arange(tokens.shape[1])[None], capture=True)
        support = np.stack([response, response, (response + 1) % len(VOCABULARY),
                            (response + 2) % len(VOCABULARY)], axis=1)
        out.append(Sample(sample_id=i, group_id=i // 2, rollout_id=0, policy_version=0,
                          prompt_ids=prompt, response_ids=response,
                          loss_mask=np.ones(len(response), np.uint8),
                          rollout_logprobs=np.full(len(response), -1.0, np.float32),
                          sample_support=support,
                          routed_experts=traced.routed_experts[0].numpy().astype(np.int32),
                          indexer_topk=traced.indexer_topk[0].numpy().astype(np.int32)))
    return out


def _loss(logp: torch.Tensor) -> torch.Tensor:
    return -(logp * torch.linspace(-1.0, 1.0, len(logp))).sum()


def _pair(checkpoint) -> tuple[TorchBackend, FSDPBackend]:
    reference = TorchBackend(str(checkpoint), _config(), list(VOCABULARY))
    fsdp = FSDPBackend(str(checkpoint), _config(train_backend="fsdp"), list(VOCABULARY))
    _randomize_adapters(reference.model)
    _randomize_adapters(fsdp.model)
    return reference, fsdp


def test_a_lora_step_on_fsdp_equals_the_torch_backends(checkpoint):
    reference, fsdp = _pair(checkpoint)
    # only the adapters train and sit in the optimizer: r x (in + out) per adapted nn.Linear
    plain = TorchBackend(str(checkpoint), TrainerConfig(), list(VOCABULARY)).model
    by_hand = sum(4 * (m.in_features + m.out_features) for name, m in plain.named_modules()
                  if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in DEFAULT_TARGETS)
    in_optimizer = sum(p.numel() for g in fsdp.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for p in fsdp.model.parameters() if p.requires_grad) == by_hand
    start = {k: v.copy() for k, v in fsdp.push_arrays(full=True).items()}
    before = {k: v for k, v in start.items() if not k.endswith((".lora_A", ".lora_B"))}
    batch = collate(_samples(reference.model), routing=True, indexer=True, support=True)
    want, got = reference.preflight_logprobs(batch), fsdp.preflight_logprobs(batch)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-6)
    for field in ("routed_experts", "own_routed_experts", "indexer_topk", "own_indexer_topk"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    norms = []
    for backend in (reference, fsdp):
        backend.zero_grad()
        out = backend.forward_backward(batch, _loss, capture=True)
        torch.testing.assert_close(out.logprobs, want.logprobs, rtol=0, atol=1e-6)
        norms.append(backend.clip_and_step(1.0))
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    # the merged policies agree, and they moved
    merged, expected = fsdp.weights(), reference.weights()
    assert set(merged) == set(expected) == set(before)
    for name, array in expected.items():
        np.testing.assert_allclose(merged[name], array, rtol=0, atol=1e-6, err_msg=name)
    # the push: the torch backend's LoRA bundle, key for key
    for full in (True, False):
        pushed, want_push = fsdp.push_arrays(full=full), unpack_arrays(reference.weight_bundle(full=full))
        assert list(pushed) == list(want_push)
        for name, array in want_push.items():
            np.testing.assert_allclose(pushed[name], array, rtol=0, atol=1e-6, err_msg=name)
    adapters_only = fsdp.push_arrays(full=False)
    assert adapters_only and all(k.endswith((".lora_A", ".lora_B")) for k in adapters_only)
    assert sum(a.nbytes for a in adapters_only.values()) == 4 * by_hand
    # the base weights did not move (bit for bit), the adapters of experts and attention did
    after = fsdp.push_arrays(full=True)
    for name, array in before.items():
        np.testing.assert_array_equal(after[name], array, err_msg=name)
    moved = [k for k, a in adapters_only.items() if not np.array_equal(a, start[k])]
    assert any(".experts." in k for k in moved) and any("self_attn" in k for k in moved)


def test_a_lora_checkpoint_holds_the_torch_backends_files_and_round_trips(checkpoint, tmp_path):
    from safetensors.torch import load_file

    reference, fsdp = _pair(checkpoint)
    batch = collate(_samples(reference.model), routing=True, indexer=True, support=True)
    for backend in (reference, fsdp):
        backend.zero_grad()
        backend.forward_backward(batch, _loss)
        backend.clip_and_step(1.0)
    fsdp.save_checkpoint(tmp_path / "fsdp", 5)
    reference.save_checkpoint(tmp_path / "torch", 5)
    assert sorted(p.name for p in (tmp_path / "fsdp").iterdir()) == ["adapter", "fsdp_state.rank0.pt", "model"]
    ours, theirs = (json.loads((tmp_path / d / "adapter" / "adapter_config.json").read_text())
                    for d in ("fsdp", "torch"))
    assert ours == theirs
    for part in ("adapter/adapter_model.safetensors", "model/model.safetensors"):
        got, want = load_file(str(tmp_path / "fsdp" / part)), load_file(str(tmp_path / "torch" / part))
        assert set(got) == set(want), part
        for key, t in want.items():
            torch.testing.assert_close(got[key], t, rtol=0, atol=1e-6, msg=key)
    assert FSDPBackend.check_checkpoint(tmp_path / "fsdp", _config(train_backend="fsdp")) == 5
    with pytest.raises(ValueError, match="lora_alpha"):
        FSDPBackend.check_checkpoint(tmp_path / "fsdp", _config(train_backend="fsdp", lora_alpha=4.0))
    saved = fsdp.digest()
    fsdp.zero_grad()
    fsdp.forward_backward(batch, _loss)
    fsdp.clip_and_step(1.0)
    assert fsdp.digest() != saved
    assert fsdp.load_checkpoint(tmp_path / "fsdp") == 5
    assert fsdp.digest() == saved  # base, adapters and both Adam moments, bit for bit


def test_lora_is_accepted_on_fsdp_and_refused_on_megatron():
    assert TrainerConfig(lora_rank=8, train_backend="fsdp").lora_rank == 8
    with pytest.raises(TrainerConfigError, match="--train-backend torch or fsdp"):
        TrainerConfig(lora_rank=8, train_backend="megatron")


async def test_the_trainer_actor_pushes_the_base_once_then_only_the_adapters(checkpoint):
    """The trainer's collective push path (``--train-backend fsdp``: every rank gathers, rank 0
    sends): the first bundle holds the base weights and the factors, a later one only the
    factors, each the backend's :meth:`push_arrays`."""
    from replayrl.trainer.trainer_actor import TrainerActor

    actor = TrainerActor(str(checkpoint), _config(train_backend="fsdp").to_dict(), n_samples_per_prompt=2,
                         engines=[], rollout_batch_size=1, vocab_tokens=list(VOCABULARY))
    assert actor.backend.collective_io
    for full in (True, False):
        arrays = unpack_arrays(await actor._weight_bundle(full=full))
        want = actor.backend.push_arrays(full=full)
        assert list(arrays) == list(want)
        for name, array in want.items():
            np.testing.assert_array_equal(arrays[name], array, err_msg=name)
        factors = [k for k in arrays if k.endswith((".lora_A", ".lora_B"))]
        assert factors and (len(factors) < len(arrays)) == full
