"""``--device`` in the torch and fsdp backends: the policy, its gradients and its optimizer state
live on the rank's device, a batch goes there for each forward and what comes back crosses the
backend interface on the CPU; on the CPU nothing else changes (the same step, bit for bit), and
on a CUDA device with bf16 the forwards compute in bf16 over fp32 master weights. The CUDA cases
are marked ``gpu`` (tests/devices.py): skipped here, with the reason, where torch sees no CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint
from replayrl.trainer.backends.fsdp_backend import FSDPBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.ranks.rank_step import RankStep
from tests.backend_fixtures import traced_samples, train_step
from tests.devices import DEVICES

pytestmark = pytest.mark.usefixtures("one_rank_group")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_initial_checkpoint(build_config({}), tmp_path_factory.mktemp("init") / "model")


def _batch(backend):
    model = backend.model
    if backend.device.type != "cpu":  # the samples' traces are the policy's own, on the CPU
        model = TorchBackend(backend.checkpoint_dir, TrainerConfig(device="cpu"), list(VOCABULARY)).model
    return collate(traced_samples(model, len(VOCABULARY)), routing=True, indexer=True, support=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend_cls", [TorchBackend, FSDPBackend], ids=["torch", "fsdp"])
def test_weights_gradients_and_optimizer_state_live_on_the_device(checkpoint, device, backend_cls):
    name = "fsdp" if backend_cls is FSDPBackend else "torch"
    backend = backend_cls(str(checkpoint), TrainerConfig(device=device, train_backend=name), list(VOCABULARY))
    assert backend.device.type == device
    assert {_local(p).device.type for p in backend.model.parameters()} == {device}
    assert all(p.dtype == torch.float32 for p in backend.model.parameters())  # the master weights
    batch = _batch(backend)
    assert batch.tokens.device.type == "cpu"
    forward = backend.preflight_logprobs(batch)
    # what crosses the interface is on the CPU, whatever the device
    assert forward.logprobs.device.type == "cpu" and forward.logprobs.dtype == torch.float32
    assert forward.routed_experts.device.type == "cpu" and forward.indexer_topk.device.type == "cpu"
    assert np.isfinite(train_step(backend, batch))
    moments = [_local(v) for state in backend.optimizer.state.values() for k, v in state.items()
               if k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.device.type for m in moments} == {device}
    weights = backend.weights()
    assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in weights.values())
    # the proximal cache pins host memory exactly for a CUDA trainer
    assert RankStep(backend, backend.config).cache.pinned is (device == "cuda")


def test_on_the_cpu_auto_takes_the_same_step_bit_for_bit(checkpoint):
    if torch.cuda.is_available():
        pytest.skip("auto is CUDA on this machine")
    explicit = TorchBackend(str(checkpoint), TrainerConfig(device="cpu"), list(VOCABULARY))
    auto = TorchBackend(str(checkpoint), TrainerConfig(), list(VOCABULARY))
    assert explicit.compute_dtype is None and auto.compute_dtype is None
    batch = _batch(explicit)
    assert train_step(explicit, batch) == train_step(auto, batch)
    assert explicit.digest() == auto.digest()


@pytest.mark.gpu
def test_bf16_compute_over_fp32_weights_stays_near_the_fp32_forward(checkpoint):
    backend = TorchBackend(str(checkpoint), TrainerConfig(device="cuda"), list(VOCABULARY))
    if not torch.cuda.is_bf16_supported():
        assert backend.compute_dtype is None
        pytest.skip("this CUDA device computes no bf16")
    assert backend.compute_dtype is torch.bfloat16
    reference = TorchBackend(str(checkpoint), TrainerConfig(device="cpu"), list(VOCABULARY))
    batch = _batch(backend)
    got = backend.preflight_logprobs(batch)
    want = reference.preflight_logprobs(batch)
    # replayed routing and keys: the same experts and keys whatever the precision
    assert torch.equal(got.routed_experts, want.routed_experts)
    assert torch.equal(got.indexer_topk, want.indexer_topk)
    assert float((got.logprobs - want.logprobs).abs().max()) < 0.1
    train_step(backend, batch)
    assert all(p.dtype == torch.float32 for p in backend.model.parameters())
