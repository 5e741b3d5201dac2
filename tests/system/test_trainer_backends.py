"""Trainer backends: the registry (lazy, typed error, config check naming the flag) and the torch
backend against independent computations (preflight = a plain forward, clip + step = float64
grad norm and a hand-written AdamW step, fail-closed on a non-finite norm, checkpoint round trip)."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from replayrl.actors.errors import VersionRegression
from replayrl.rollout.model.checkpoint import save_pretrained
from replayrl.rollout.model.config import default_config
from replayrl.rollout.model.errors import CheckpointError
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.sample import Sample
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.rollout.weight_sync.shm import ShmSync
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.trainer.backends import BACKENDS, resolve_backend
from replayrl.trainer.backends.base import ReplayedForward, TrainerBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import TrainerConfigError, UnknownBackendError
from replayrl.transport.array_bundle import pack_arrays, unpack_arrays

V = len(VOCABULARY)


# ----------------------------------------------------------------- registry


def test_registry_resolves_torch_to_the_torch_backend():
    assert BACKENDS["torch"] == "replayrl.trainer.backends.torch_backend:TorchBackend"
    cls = resolve_backend("torch")
    assert cls is TorchBackend and issubclass(cls, TrainerBackend)
    assert BACKENDS["megatron"] == "replayrl.trainer.backends.megatron_backend:MegatronBackend"
    with pytest.raises(TypeError):
        BACKENDS["megatron"] = "x:Y"  # one registry, read-only


def test_unknown_backend_is_named_with_the_known_ones():
    with pytest.raises(UnknownBackendError, match=r"'nope'.*known backends: fsdp, megatron, torch"):
        resolve_backend("nope")
    assert issubclass(UnknownBackendError, ValueError)


def test_unknown_backend_is_a_configuration_error_naming_the_flag():
    with pytest.raises(TrainerConfigError, match=r"--train-backend must be torch"):
        TrainerConfig(train_backend="nope")
    with pytest.raises(ConfigError, match="--train-backend"):
        build_config({"train-backend": "nope", "progress": False})
    assert build_config({"train-backend": "torch"}).trainer.train_backend == "torch"
    assert TrainerConfig().train_backend == "torch"


def test_registry_and_config_do_not_import_a_backend():
    # the registry holds strings: choosing a backend is what imports it (megatron-core later)
    code = ("import sys, replayrl.trainer.config, replayrl.trainer.backends; "
            "assert 'replayrl.trainer.backends.torch_backend' not in sys.modules, 'imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------- the torch backend


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the backend sets the process's threads from its config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = Qwen3MoeForCausalLM(default_config(V))
    model.init_weights(3)
    return save_pretrained(model, tmp_path_factory.mktemp("ckpt"), tokens=list(VOCABULARY))


def _samples(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, r) in enumerate([(4, 3), (6, 2)]):
        out.append(Sample(sample_id=i, group_id=0, rollout_id=0, policy_version=0,
                          prompt_ids=rng.integers(0, V, p).astype(np.int32),
                          response_ids=rng.integers(0, V, r).astype(np.int32),
                          loss_mask=np.ones(r, np.uint8), rollout_logprobs=np.zeros(r, np.float32)))
    return out


def _backend(checkpoint, **kw) -> TorchBackend:
    cfg = TrainerConfig(use_support_replay=False, temperature=0.8, **kw)
    return resolve_backend(cfg.train_backend)(str(checkpoint), cfg, list(VOCABULARY))


def test_preflight_is_a_plain_forward_at_the_temperature(checkpoint):
    backend = _backend(checkpoint)
    samples = _samples()
    out = backend.preflight_logprobs(collate(samples, routing=False, indexer=False, support=False))
    assert isinstance(out, ReplayedForward) and not out.logprobs.requires_grad
    assert out.routed_experts is not None and out.own_routed_experts is not None
    # independent: each sample alone, float64 log-softmax of logits / T at the response tokens
    model = backend.model
    expected = []
    for s in samples:
        tokens = torch.from_numpy(s.tokens.astype(np.int64))[None]
        with torch.no_grad():
            z = model(tokens, torch.arange(tokens.shape[1])[None]).logits[0].double() / 0.8
        for j, y in enumerate(s.response_ids):
            expected.append(float(torch.log_softmax(z[len(s.prompt_ids) - 1 + j], -1)[y]))
    np.testing.assert_allclose(out.logprobs.numpy(), expected, atol=1e-5)
    assert backend.model_config.moe_layers == default_config(V).moe_layers


def test_clip_and_step_is_clipped_adamw(checkpoint):
    backend = _backend(checkpoint, lr=1e-2, clip_grad=1e-3, weight_decay=0.1)
    batch = collate(_samples(), routing=False, indexer=False, support=False)
    before = {n: p.detach().double().clone() for n, p in backend.model.named_parameters()}
    backend.zero_grad()
    backend.backward(-backend.train_logprobs(batch).sum())
    grads = {n: p.grad.double().clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
    got = backend.clip_and_step(1e-3)
    assert got == pytest.approx(norm, rel=1e-5)
    # first AdamW step by hand: decoupled decay, then m / (sqrt(v) + eps), eps = --adam-eps
    scale = min(1.0, 1e-3 / (norm + 1e-6))
    for n, p in backend.model.named_parameters():
        if n not in grads:
            continue
        g = grads[n] * scale
        m_hat, v_hat = g, g * g
        want = before[n] * (1 - 1e-2 * 0.1) - 1e-2 * m_hat / (v_hat.sqrt() + backend.config.adam_eps)
        torch.testing.assert_close(p.detach().double(), want, atol=1e-6, rtol=1e-5)


def test_non_finite_norm_leaves_weights_and_optimizer_untouched(checkpoint, tmp_path):
    backend = _backend(checkpoint)
    batch = collate(_samples(), routing=False, indexer=False, support=False)
    backend.zero_grad()
    backend.backward(-backend.train_logprobs(batch).sum())
    assert math.isfinite(backend.clip_and_step(1.0))  # one real step: optimizer moments exist
    before = backend.digest()
    backend.zero_grad()
    backend.backward(backend.train_logprobs(batch).sum() * float("nan"))
    assert math.isnan(backend.clip_and_step(1.0))
    assert backend.digest() == before
    assert all(p.grad is None for p in backend.model.parameters())


def _saved_after_one_step(checkpoint, directory):
    """A backend that took one optimizer step and saved it to ``directory`` as version 5."""
    backend = _backend(checkpoint)
    batch = collate(_samples(), routing=False, indexer=False, support=False)
    backend.zero_grad()
    backend.backward(-backend.train_logprobs(batch).sum())
    backend.clip_and_step(1.0)
    backend.save_checkpoint(directory, 5)
    return backend


def test_checkpoint_round_trip_restores_weights_optimizer_version_and_rng(checkpoint, tmp_path):
    backend = _saved_after_one_step(checkpoint, tmp_path)
    saved, draw = backend.digest(), torch.rand(3)
    fresh = _backend(checkpoint)
    assert fresh.digest() != saved
    assert fresh.load_checkpoint(tmp_path) == 5
    assert fresh.digest() == saved and torch.equal(torch.rand(3), draw)
    assert set(fresh.weights()) == {k[len("param/"):] for k in saved if k.startswith("param/")}
    assert fresh.parameter_count() == sum(p.numel() for p in fresh.model.parameters())


def _corrupt_optimizer(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    state["optimizer"]["param_groups"].append(dict(state["optimizer"]["param_groups"][0]))  # one group too many
    torch.save(state, path)


@pytest.mark.parametrize("damage", ["optimizer", "truncated", "version", "model"])
def test_rejected_checkpoint_changes_nothing(checkpoint, tmp_path, damage):
    _saved_after_one_step(checkpoint, tmp_path)
    state_file = tmp_path / "trainer_state.pt"
    if damage == "optimizer":
        _corrupt_optimizer(state_file)
    elif damage == "truncated":
        state_file.write_bytes(state_file.read_bytes()[:100])
    elif damage == "version":
        state = torch.load(state_file, weights_only=True)
        state["version"] = -1
        torch.save(state, state_file)
    else:
        weights = next((tmp_path / "model").glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[:1000])
    fresh = _backend(checkpoint)
    before, draw_state = fresh.digest(), torch.get_rng_state()
    with pytest.raises((ValueError, CheckpointError)):
        fresh.load_checkpoint(tmp_path)
    with pytest.raises((ValueError, CheckpointError)):
        type(fresh).check_checkpoint(tmp_path, TrainerConfig())
    assert fresh.digest() == before  # new weights were not swapped in before the refusal
    assert torch.equal(torch.get_rng_state(), draw_state)


def test_older_checkpoint_is_refused_like_any_version_regression(checkpoint, tmp_path):
    backend = _backend(checkpoint)
    backend.save_checkpoint(tmp_path, 2)
    before = backend.digest()
    with pytest.raises(VersionRegression, match="version 2, behind the trainer's 3"):
        backend.load_checkpoint(tmp_path, min_version=3)
    assert backend.digest() == before
    assert backend.load_checkpoint(tmp_path, min_version=2) == 2


def test_forwards_report_the_entropy_over_each_tokens_support(checkpoint):
    cfg = TrainerConfig(use_support_replay=True, temperature=0.8)
    backend = resolve_backend(cfg.train_backend)(str(checkpoint), cfg, list(VOCABULARY))
    samples = []
    rng = np.random.default_rng(4)
    for s in _samples():
        R = len(s.response_ids)
        support = np.full((R, 1 + 4), -1, np.int32)
        support[:, 0] = s.response_ids
        for j in range(R):  # the sampled id and 1..3 others, the rest excluded
            others = [v for v in rng.permutation(V)[:4].tolist() if v != s.response_ids[j]][:1 + j]
            row = [int(s.response_ids[j]), *others]
            support[j, 1:1 + len(row)] = row
        samples.append(Sample(sample_id=s.sample_id, group_id=0, rollout_id=0, policy_version=0,
                              prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                              loss_mask=s.loss_mask, rollout_logprobs=s.rollout_logprobs,
                              sample_support=support))
    batch = collate(samples, routing=False, indexer=False, support=True)
    pre, train = backend.preflight_logprobs(batch), backend.train_forward(batch)
    # independent: each sample alone, float64 softmax of logits / T over the support's ids
    expected = []
    for s in samples:
        tokens = torch.from_numpy(s.tokens.astype(np.int64))[None]
        with torch.no_grad():
            z = backend.model(tokens, torch.arange(tokens.shape[1])[None]).logits[0].double() / 0.8
        for j in range(len(s.response_ids)):
            ids = [int(v) for v in s.sample_support[j, 1:] if v >= 0]
            p = torch.softmax(z[len(s.prompt_ids) - 1 + j, ids], -1)
            expected.append(float(-(p * p.log()).sum()))
    np.testing.assert_allclose(pre.support_entropy.numpy(), expected, atol=1e-5)
    np.testing.assert_allclose(train.support_entropy.numpy(), expected, atol=1e-5)
    assert not train.support_entropy.requires_grad


def _train_once(backend: TorchBackend) -> None:
    """One optimizer step through the backend (``clip_and_step``) on a loss of every weight."""
    backend.zero_grad()
    sum((p.float() ** 2).sum() for p in backend.params).backward()
    backend.clip_and_step(1.0)


def _snapshot(backend: TorchBackend) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in backend.model.state_dict().items()}


def test_a_shm_push_holds_the_weights_as_pack_arrays_does(checkpoint):
    backend = _backend(checkpoint)
    bundle = ShmSync().pack(backend.push_tensors(), version=0, home=backend).payload
    reference = pack_arrays(backend.weights())  # the generic path: per-array copies
    assert [e[0] for e in bundle["entries"]] == [e[0] for e in reference["entries"]]
    got, expected = unpack_arrays(bundle), unpack_arrays(reference)
    assert all(np.array_equal(got[k], expected[k]) and got[k].shape == expected[k].shape
               for k in expected)


def test_a_push_in_flight_keeps_its_weights_while_training_goes_on(checkpoint):
    # the weights live in the push's shared-memory slot (docs/design/transport.md#shm-transport,
    # "Live path"), so a push is sent with no copy; a step while an engine still reads it moves the
    # weights out first, a step after it was released trains in place
    from replayrl.actors.ref import shared_memory_pool
    from replayrl.transport import Codec
    from replayrl.transport.shm_pool import ShmReader, mark_sent

    backend, codec, reader, sync = _backend(checkpoint), Codec(), ShmReader(), ShmSync()
    pool = shared_memory_pool()

    def weight_bundle() -> dict:  # the shm sync's push of the backend's weights
        return sync.pack(backend.push_tensors(), version=0, home=backend).payload

    first = next(iter(backend.model.state_dict()))

    def home() -> int:
        return backend.model.state_dict()[first].data_ptr()

    def send(bundle):  # an engine call's encoding (made when the call is made) and its receipt
        frames = codec.encode(bundle, pool)
        mark_sent(frames)
        return unpack_arrays(codec.decode(frames, reader))

    pushed = _snapshot(backend)
    received = send(weight_bundle())
    busy = pool.busy()
    assert all(np.array_equal(received[k], pushed[k]) for k in pushed)
    before = home()
    _train_once(backend)  # the engine still holds `received`: the weights move out first
    assert home() != before
    assert all(np.array_equal(received[k], pushed[k]) for k in pushed)  # what it reads is intact
    trained = _snapshot(backend)
    assert any(not np.array_equal(trained[k], pushed[k]) for k in pushed)
    del received  # loaded: the engine drops its views, which releases the old slot
    assert pool.busy() == busy  # the old slot went back to the pool, the weights hold the new
    received = send(weight_bundle())
    assert all(np.array_equal(received[k], trained[k]) for k in trained)
    slot_bytes = pool.slot_bytes
    del received
    before = home()
    _train_once(backend)  # released: the step trains in place, no copy, no new slot
    assert home() == before and pool.slot_bytes == slot_bytes
    first_engine = weight_bundle()
    a = send(first_engine)
    b = send(first_engine)  # a second engine's call of the same push: a copy of its own
    assert a[first].ctypes.data != b[first].ctypes.data  # (the free slot of before)
    _train_once(backend)
    now = _snapshot(backend)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], now[k]) for k in now)
