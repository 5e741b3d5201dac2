"""--train-backend fsdp in one process (a world-size-1 gloo group): the FSDP2-sharded policy
gives the torch backend's logprobs, replayed choices, gradient norm and step on the embedded
Qwen3-MoE with its DSA indexer; its checkpoint round-trips and carries its layout; what cannot
run is refused before start, naming the flags. Two ranks: tests/system/test_fsdp_ranks.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from replayrl.rollout.model.loader import load_pretrained
from replayrl.rollout.sample import Sample
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.config import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint
from replayrl.trainer.backends import resolve_backend
from replayrl.trainer.backends.fsdp_backend import FSDPBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batch import collate
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import CheckpointLayoutError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_initial_checkpoint(build_config({}), tmp_path_factory.mktemp("init") / "model")


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the backends set the process's threads
    if dist.is_initialized():  # the group of one the fsdp backend made in this process
        dist.destroy_process_group()


def _samples(model) -> list[Sample]:
    """Four samples of two groups; routing / indexer traces are the model's own choices (none
    for a model without the layers), each
    response token's support its token and two others (support replay)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(4):
        prompt = rng.integers(3, len(VOCABULARY), 5).astype(np.int32)
        response = rng.integers(3, len(VOCABULARY), 3 + i).astype(np.int32)
        tokens = torch.from_numpy(np.r_[prompt, response][:-1].astype(np.int64))[None]
        with torch.no_grad():
            traced = model(tokens, torch.arange(tokens.shape[1])[None], capture=True)
        support = np.stack([response, response, (response + 1) % len(VOCABULARY),
                            (response + 2) % len(VOCABULARY)], axis=1)
        out.append(Sample(sample_id=i, group_id=i // 2, rollout_id=0, policy_version=0,
                          prompt_ids=prompt, response_ids=response,
                          loss_mask=np.ones(len(response), np.uint8),
                          rollout_logprobs=np.full(len(response), -1.0, np.float32),
                          sample_support=support,
                          routed_experts=traced.routed_experts[0].numpy().astype(np.int32),
                          indexer_topk=None if traced.indexer_topk is None
                          else traced.indexer_topk[0].numpy().astype(np.int32)))
    return out


def _loss(logp: torch.Tensor) -> torch.Tensor:
    return -(logp * torch.linspace(-1.0, 1.0, len(logp))).sum()


@pytest.mark.parametrize("chunk", [0, 2], ids=["logits", "fused-lm-head"])
def test_the_sharded_policy_takes_the_torch_backends_step(checkpoint, chunk):
    config = TrainerConfig(logprobs_chunk_size=chunk)
    reference = TorchBackend(str(checkpoint), config, list(VOCABULARY))
    fsdp = resolve_backend("fsdp")(str(checkpoint), TrainerConfig(
        train_backend="fsdp", logprobs_chunk_size=chunk), list(VOCABULARY))
    assert isinstance(fsdp, FSDPBackend) and fsdp.collective_io and fsdp.collective_forward
    assert fsdp.data_parallel() == (0, 1)
    assert fsdp.parameter_count() == reference.parameter_count()
    assert fsdp.model_config == reference.model_config
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
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)
    before = load_pretrained(checkpoint)[0].state_dict()
    weights, expected = fsdp.weights(), reference.weights()
    assert set(weights) == set(expected) == set(before)
    for name, array in expected.items():
        assert weights[name].dtype == np.float32
        np.testing.assert_allclose(weights[name], array, rtol=0, atol=1e-6, err_msg=name)
    assert max(float(np.abs(expected[n] - before[n].numpy()).max()) for n in expected) > 1e-4


def test_a_checkpoint_round_trips_and_names_its_backend_and_layout(checkpoint, tmp_path):
    config = TrainerConfig(train_backend="fsdp")
    fsdp = FSDPBackend(str(checkpoint), config, list(VOCABULARY))
    batch = collate(_samples(fsdp.model), routing=True, indexer=True, support=True)
    fsdp.zero_grad()
    fsdp.forward_backward(batch, _loss)
    fsdp.clip_and_step(1.0)
    saved = fsdp.digest()
    fsdp.save_checkpoint(tmp_path / "ckpt", 3)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["fsdp_state.rank0.pt", "model"]
    assert FSDPBackend.check_checkpoint(tmp_path / "ckpt", config) == 3
    # its HF model holds the weights of the push
    hf = load_pretrained(tmp_path / "ckpt" / "model")[0].state_dict()
    for name, array in fsdp.weights().items():
        np.testing.assert_array_equal(hf[name].numpy(), array, err_msg=name)
    fsdp.zero_grad()
    fsdp.forward_backward(batch, _loss)
    fsdp.clip_and_step(1.0)
    assert fsdp.digest() != saved
    assert fsdp.load_checkpoint(tmp_path / "ckpt") == 3
    assert fsdp.digest() == saved  # weights and both Adam moments, bit for bit
    with pytest.raises(CheckpointLayoutError, match=r"saved with .*--dp-size 1; this run asks "
                                                    r"for .*--dp-size 2"):
        FSDPBackend.check_checkpoint(tmp_path / "ckpt", TrainerConfig(train_backend="fsdp",
                                                                      dp_size=2))
    with pytest.raises(CheckpointLayoutError, match="written by --train-backend fsdp, this run "
                                                    "uses --train-backend torch"):
        TorchBackend.check_checkpoint(tmp_path / "ckpt", TrainerConfig())
    torch_backend = TorchBackend(str(checkpoint), TrainerConfig(), list(VOCABULARY))
    torch_backend.save_checkpoint(tmp_path / "torch", 1)
    with pytest.raises(CheckpointLayoutError, match="written by --train-backend torch, this run "
                                                    "uses --train-backend fsdp"):
        fsdp.load_checkpoint(tmp_path / "torch")


def test_model_parallel_flags_are_refused_with_fsdp_before_start():
    small = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "train-backend": "fsdp"}
    for flag in ("tp-size", "ep-size", "pp-size"):
        with pytest.raises(ConfigError, match=r"--tp-size / --ep-size / --pp-size need "
                                              r"--train-backend megatron \(--train-backend fsdp "
                                              r"splits only the data over --dp-size ranks\)"):
            build_config({**small, flag: 2, "dp-size": 2})
    with pytest.raises(ConfigError, match=r"--cp-size needs --train-backend megatron "
                                          r"\(--train-backend fsdp"):
        build_config({**small, "cp-size": 2})
    with pytest.raises(ConfigError, match="do not split evenly over --dp-size 3"):
        build_config({**small, "dp-size": 3})
    assert build_config({**small, "dp-size": 4}).trainer.train_backend == "fsdp"


def test_a_transformers_qwen3_moe_checkpoint_trains_sharded_and_saves_for_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(VOCABULARY), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    reference = TorchBackend(str(tmp_path / "hf"), TrainerConfig(), [])
    fsdp = FSDPBackend(str(tmp_path / "hf"), TrainerConfig(train_backend="fsdp"), [])
    samples = _samples(reference.model)
    assert samples[0].indexer_topk is None and samples[0].routed_experts is not None
    batch = collate(samples, routing=True, indexer=False, support=True)
    for backend in (reference, fsdp):
        backend.zero_grad()
        backend.forward_backward(batch, _loss)
        backend.clip_and_step(1.0)
    fsdp.save_hf(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.from_numpy(samples[0].tokens.astype(np.int64))[None]
    with torch.no_grad():
        want = reference.model(tokens, torch.arange(tokens.shape[1])[None]).logits
        got = loaded(tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
