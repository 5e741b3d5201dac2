"""--train-backend fsdp in one process (a world-size-1 gloo group): the FSDP2-sharded policy
gives the torch backend's logprobs, replayed choices, gradient norm and step on the embedded
Qwen3-MoE with its DSA indexer; its checkpoint round-trips and carries its layout; what cannot
run is refused before start, naming the flags. Two ranks: tests/system/test_fsdp_ranks.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.model.loader import load_pretrained
from replayrl.rollout.sample import Sample
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint
from replayrl.trainer.backends import resolve_backend
from replayrl.trainer.backends.fsdp_backend import FSDPBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import CheckpointLayoutError
from tests.backend_fixtures import assert_fsdp_takes_the_torch_step, assert_same_arrays, traced_samples, train_step

pytestmark = pytest.mark.usefixtures("one_rank_group")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_initial_checkpoint(build_config({}), tmp_path_factory.mktemp("init") / "model")


def _samples(model) -> list[Sample]:
    return traced_samples(model, len(VOCABULARY))


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
    assert_fsdp_takes_the_torch_step(reference, fsdp, batch, atol=1e-6, rel=1e-6)
    before = load_pretrained(checkpoint)[0].state_dict()
    weights, expected = fsdp.weights(), reference.weights()
    assert_same_arrays(weights, expected, atol=1e-6, keys=before)
    assert all(a.dtype == np.float32 for a in weights.values())
    assert max(float(np.abs(expected[n] - before[n].numpy()).max()) for n in expected) > 1e-4


def test_a_checkpoint_round_trips_and_names_its_backend_and_layout(checkpoint, tmp_path):
    config = TrainerConfig(train_backend="fsdp")
    fsdp = FSDPBackend(str(checkpoint), config, list(VOCABULARY))
    batch = collate(_samples(fsdp.model), routing=True, indexer=True, support=True)
    train_step(fsdp, batch)
    saved = fsdp.digest()
    fsdp.save_checkpoint(tmp_path / "ckpt", 3)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["fsdp_state.rank0.pt", "model"]
    assert FSDPBackend.check_checkpoint(tmp_path / "ckpt", config) == 3
    # its HF model holds the weights of the push
    hf = load_pretrained(tmp_path / "ckpt" / "model")[0].state_dict()
    for name, array in fsdp.weights().items():
        np.testing.assert_array_equal(hf[name].numpy(), array, err_msg=name)
    train_step(fsdp, batch)
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
        train_step(backend, batch)
    fsdp.save_hf(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.from_numpy(samples[0].tokens.astype(np.int64))[None]
    with torch.no_grad():
        want = reference.model(tokens, torch.arange(tokens.shape[1])[None]).logits
        got = loaded(tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
