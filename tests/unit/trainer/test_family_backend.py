"""The torch trainer backend on a family checkpoint (rollout/model/families/): replayed
training forward with gradients, an optimizer step, and a checkpoint round trip."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.model.loader import load_pretrained
from replayrl.rollout.sample import Sample
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.config import TrainerConfig
from tests.family_checkpoints import tiny_hf_checkpoint


def _samples(model, vocab, n=3, seed=0):
    """Samples whose traces are what `model` itself chose (a fp32 'engine')."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = 6 + i, 4
        tokens = rng.integers(0, vocab, p + r)
        with torch.no_grad():
            o = model(torch.from_numpy(tokens[None, :-1]), torch.arange(p + r - 1)[None],
                      capture=True)
        traces = {"routed_experts": o.routed_experts[0].numpy().astype(np.int32)}
        if o.indexer_topk is not None:
            traces["indexer_topk"] = o.indexer_topk[0].numpy().astype(np.int32)
        out.append(Sample(sample_id=i, group_id=i, rollout_id=0, policy_version=0,
                          prompt_ids=tokens[:p].astype(np.int32),
                          response_ids=tokens[p:].astype(np.int32),
                          loss_mask=np.ones(r, np.uint8), rollout_logprobs=np.zeros(r, np.float32),
                          **traces))
    return out


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "gpt_oss"])
def test_family_trains_with_replay_and_resumes(model_type, tmp_path):
    tiny_hf_checkpoint(model_type, tmp_path / "ckpt")
    engine, cfg = load_pretrained(tmp_path / "ckpt")
    samples = _samples(engine.eval(), cfg.vocab_size)
    backend = TorchBackend(str(tmp_path / "ckpt"), TrainerConfig(), [])
    batch = collate(samples, routing=True, indexer=bool(cfg.indexed_layers), support=False)
    fwd = backend.train_forward(batch)
    given = batch.routed_experts >= 0  # padding rows: the router's own choice
    used = fwd.routed_experts.long().sort(-1).values
    assert torch.equal(used[given], batch.routed_experts.long().sort(-1).values[given])
    if cfg.indexed_layers:
        given = batch.indexer_topk >= 0
        assert torch.equal(fwd.indexer_topk.long()[given], batch.indexer_topk.long()[given])
    backend.zero_grad()
    backend.backward(-fwd.logprobs.mean())
    assert np.isfinite(backend.clip_and_step(1.0))
    backend.save_checkpoint(tmp_path / "step", version=1)
    again = TorchBackend(str(tmp_path / "ckpt"), TrainerConfig(), [])
    assert again.load_checkpoint(tmp_path / "step") == 1
    for name, t in backend.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], t), name


def test_family_weights_live_in_the_push_slot_and_train_there(tmp_path):
    # the weights living in the push's slot (docs/design/transport.md#shm-transport, "Live path")
    # on a wrapper whose state_dict renames (FamilyModel drops `hf.`): the weights are found by
    # identity, moved into the push's slot, and the optimizer steps them there
    from replayrl.actors.ref import shared_memory_pool
    from replayrl.rollout.weight_sync.shm import ShmSync
    from replayrl.transport.array_bundle import unpack_arrays

    tiny_hf_checkpoint("glm_moe_dsa", tmp_path / "ckpt")
    backend, sync = TorchBackend(str(tmp_path / "ckpt"), TrainerConfig(), []), ShmSync()

    def push() -> dict[str, np.ndarray]:
        return unpack_arrays(sync.pack(backend.push_tensors(), version=0, home=backend).payload)

    before = {k: v.detach().clone() for k, v in backend.model.state_dict().items()}
    pushed = push()
    assert sorted(pushed) == sorted(before)
    assert all(np.array_equal(pushed[k], before[k].numpy()) for k in before)
    assert shared_memory_pool() is not None  # on by default
    name = next(iter(before))  # the weights are the push, not a copy of it
    assert pushed[name].ctypes.data == backend.model.state_dict()[name].data_ptr()
    backend.zero_grad()
    sum((p.float() ** 2).sum() for p in backend.params).backward()
    assert np.isfinite(backend.clip_and_step(1.0))
    after = backend.model.state_dict()
    trained = [k for k in before if not torch.equal(after[k], before[k])]
    assert trained and all(p.requires_grad for n, p in backend.model.hf.named_parameters()
                           if n in trained)
    again = push()
    assert all(np.array_equal(again[k], after[k].numpy()) for k in after)
