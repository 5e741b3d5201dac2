"""--train-backend fsdp on a model family (rollout/model/families/: transformers' model with our
router and indexer hooks) in one process (a world-size-1 gloo group): the FSDP2-sharded tiny
GLM-5 (`glm_moe_dsa`, DSA indexer) gives the torch backend's logprobs, replayed choices,
gradient norm and step; its checkpoint round-trips; its HF save loads in transformers and
gives the torch backend's logits. Two ranks: tests/system/test_fsdp_ranks.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from replayrl.rollout.model.families.base import FamilyModel
from replayrl.rollout.sample import Sample
from replayrl.tools.run.config import build_config
from replayrl.trainer.backends.fsdp_backend import FSDPBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batch import collate
from replayrl.trainer.config import TrainerConfig
from tests.family_checkpoints import tiny_hf_checkpoint

transformers = pytest.importorskip("transformers", reason="checkpoints are written by transformers")

VOCAB = 97  # tests/family_checkpoints.py


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    directory = tmp_path_factory.mktemp("glm5") / "ckpt"
    tiny_hf_checkpoint("glm_moe_dsa", directory)
    return directory


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the backends set the process's threads
    if dist.is_initialized():  # the group of one the fsdp backend made in this process
        dist.destroy_process_group()


def _samples(model: FamilyModel) -> list[Sample]:
    """Four samples of two groups (prompts of 6 tokens, responses of 3..6: more keys than
    `index_topk` 4, so the indexer selects); routing / indexer traces are the model's own
    choices, each response token's support its token and two others."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(4):
        prompt = rng.integers(3, VOCAB, 6).astype(np.int32)
        response = rng.integers(3, VOCAB, 3 + i).astype(np.int32)
        tokens = torch.from_numpy(np.r_[prompt, response][:-1].astype(np.int64))[None]
        with torch.no_grad():
            traced = model(tokens, torch.arange(tokens.shape[1])[None], capture=True)
        support = np.stack([response, response, (response + 1) % VOCAB, (response + 2) % VOCAB],
                           axis=1)  # column 0: the sampled id, then the candidates
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


def test_a_sharded_family_policy_takes_the_torch_backends_step(glm5, tmp_path):
    reference = TorchBackend(str(glm5), TrainerConfig(), [])
    fsdp = FSDPBackend(str(glm5), TrainerConfig(train_backend="fsdp"), [])
    assert isinstance(fsdp.model, FamilyModel)
    assert fsdp.parameter_count() == reference.parameter_count()
    batch = collate(_samples(reference.model), routing=True, indexer=True, support=True)
    want, got = reference.preflight_logprobs(batch), fsdp.preflight_logprobs(batch)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    for field in ("routed_experts", "own_routed_experts", "indexer_topk", "own_indexer_topk"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    # the replays ran: wherever the batch holds a trace row, the trainer used it
    traced = (batch.routed_experts >= 0).all(-1)
    assert int(traced.sum()) > 0
    assert torch.equal(got.routed_experts[traced], batch.routed_experts[traced].to(torch.int32))
    norms = []
    for backend in (reference, fsdp):
        backend.zero_grad()
        out = backend.forward_backward(batch, _loss, capture=True)
        torch.testing.assert_close(out.logprobs, want.logprobs, rtol=0, atol=1e-5)
        norms.append(backend.clip_and_step(1.0))
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    before = FamilyModel.from_pretrained(glm5, fsdp.model_config).state_dict()
    weights, expected = fsdp.weights(), reference.weights()
    assert set(weights) == set(expected) == set(before)
    for name, array in expected.items():
        np.testing.assert_allclose(weights[name], array, rtol=0, atol=1e-5, err_msg=name)
    assert max(float(np.abs(expected[n] - before[n].numpy()).max()) for n in expected) > 1e-4
    # the HF save (gathered) loads in transformers and gives the torch backend's logits
    fsdp.save_hf(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([[1, 4, 5, 6, 7, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits,
                                   reference.model.eval()(ids, torch.arange(7)[None]).logits,
                                   rtol=0, atol=1e-4)


def test_a_family_checkpoint_round_trips(glm5, tmp_path):
    config = TrainerConfig(train_backend="fsdp")
    fsdp = FSDPBackend(str(glm5), config, [])
    batch = collate(_samples(fsdp.model), routing=True, indexer=True, support=True)
    fsdp.zero_grad()
    fsdp.forward_backward(batch, _loss)
    fsdp.clip_and_step(1.0)
    fsdp.preflight_logprobs(batch)  # a forward with no backward after it, before the save
    saved = fsdp.digest()
    fsdp.save_checkpoint(tmp_path / "ckpt", 2)
    assert FSDPBackend.check_checkpoint(tmp_path / "ckpt", config) == 2
    fsdp.zero_grad()
    fsdp.forward_backward(batch, _loss)
    fsdp.clip_and_step(1.0)
    assert fsdp.digest() != saved
    assert fsdp.load_checkpoint(tmp_path / "ckpt") == 2
    assert fsdp.digest() == saved  # weights and both Adam moments, bit for bit


def test_a_family_may_train_on_several_fsdp_ranks_but_not_torch_ddp(glm5, tmp_path):
    small = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "hf-checkpoint": str(glm5),
             "output-dir": str(tmp_path)}
    config = build_config({**small, "train-backend": "fsdp", "dp-size": 2})
    assert (config.trainer.train_backend, config.trainer.dp_size) == ("fsdp", 2)
    with pytest.raises(Exception, match=r"--dp-size 2: the 'glm_moe_dsa' family trains on one "
                                        r"rank with --train-backend torch; use --train-backend fsdp"):
        build_config({**small, "dp-size": 2})
