"""LoRA (``--lora-rank``, trainer/lora/peft_adapter.py) on --train-backend fsdp in one process (a
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

from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.from_flags import build_config
from replayrl.trainer.backends.fsdp_backend import FSDPBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import TrainerConfigError
from tests.backend_fixtures import (
    DEFAULT_TARGETS,
    adapter_size_by_hand,
    assert_fsdp_takes_the_torch_step,
    assert_same_arrays,
    assert_same_push,
    decisive_checkpoint,
    lora_config,
    randomize_adapters,
    traced_samples,
    train_step,
)

pytest.importorskip("peft", reason="peft (the lora extra) is not installed")
pytestmark = pytest.mark.usefixtures("one_rank_group")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The embedded default policy with its DSA indexer, decisive routing."""
    cfg = build_config({}).policy_config
    assert cfg.index_layers
    return decisive_checkpoint(tmp_path_factory.mktemp("init") / "model", cfg, seed=4)


def _batch(reference: TorchBackend):
    """:func:`traced_samples` of the LoRA policy's own choices, collated with every replay."""
    return collate(traced_samples(reference.model, len(VOCABULARY), adapted=True), routing=True, indexer=True,
                   support=True)


def _push(backend, full: bool) -> dict[str, np.ndarray]:
    """The backend's push (``push_tensors``) as numpy copies."""
    return {k: t.detach().cpu().numpy().copy() for k, t in backend.push_tensors(full=full).items()}


def _pair(checkpoint) -> tuple[TorchBackend, FSDPBackend]:
    reference = TorchBackend(str(checkpoint), lora_config(), list(VOCABULARY))
    fsdp = FSDPBackend(str(checkpoint), lora_config(train_backend="fsdp"), list(VOCABULARY))
    randomize_adapters(reference.model)
    randomize_adapters(fsdp.model)
    return reference, fsdp


def test_a_lora_step_on_fsdp_equals_the_torch_backends(checkpoint):
    reference, fsdp = _pair(checkpoint)
    # only the adapters train and sit in the optimizer: r x (in + out) per adapted nn.Linear
    plain = TorchBackend(str(checkpoint), TrainerConfig(), list(VOCABULARY)).model
    by_hand = adapter_size_by_hand(plain, 4, DEFAULT_TARGETS)
    in_optimizer = sum(p.numel() for g in fsdp.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for p in fsdp.model.parameters() if p.requires_grad) == by_hand
    start = _push(fsdp, full=True)
    before = {k: v for k, v in start.items() if not k.endswith((".lora_A", ".lora_B"))}
    assert_fsdp_takes_the_torch_step(reference, fsdp, _batch(reference), atol=1e-6, rel=1e-5)
    # the merged policies agree, and they moved
    assert_same_arrays(fsdp.weights(), reference.weights(), atol=1e-6, keys=before)
    # the push: the torch backend's LoRA bundle, key for key
    assert_same_push(reference, fsdp, atol=1e-6)
    adapters_only = _push(fsdp, full=False)
    assert adapters_only and all(k.endswith((".lora_A", ".lora_B")) for k in adapters_only)
    assert sum(a.nbytes for a in adapters_only.values()) == 4 * by_hand
    # the base weights did not move (bit for bit), the adapters of experts and attention did
    after = _push(fsdp, full=True)
    for name, array in before.items():
        np.testing.assert_array_equal(after[name], array, err_msg=name)
    moved = [k for k, a in adapters_only.items() if not np.array_equal(a, start[k])]
    assert any(".experts." in k for k in moved) and any("self_attn" in k for k in moved)


def test_a_lora_checkpoint_holds_the_torch_backends_files_and_round_trips(checkpoint, tmp_path):
    from safetensors.torch import load_file

    reference, fsdp = _pair(checkpoint)
    batch = _batch(reference)
    for backend in (reference, fsdp):
        train_step(backend, batch)
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
    assert FSDPBackend.check_checkpoint(tmp_path / "fsdp", lora_config(train_backend="fsdp")) == 5
    with pytest.raises(ValueError, match="lora_alpha"):
        FSDPBackend.check_checkpoint(tmp_path / "fsdp", lora_config(train_backend="fsdp", lora_alpha=4.0))
    saved = fsdp.digest()
    train_step(fsdp, batch)
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
    factors, each the backend's :meth:`push_tensors`."""
    from replayrl.trainer.ranks.trainer_actor import TrainerActor

    actor = TrainerActor(str(checkpoint), lora_config(train_backend="fsdp").to_dict(), n_samples_per_prompt=2,
                         engines=[], rollout_batch_size=1, vocab_tokens=list(VOCABULARY))
    assert actor.backend.collective_io
    for full in (True, False):
        arrays = await actor._push_tensors(full=full)
        want = actor.backend.push_tensors(full=full)
        assert list(arrays) == list(want)
        for name, t in want.items():
            np.testing.assert_array_equal(arrays[name].numpy(), t.numpy(), err_msg=name)
        factors = [k for k in arrays if k.endswith((".lora_A", ".lora_B"))]
        assert factors and (len(factors) < len(arrays)) == full
