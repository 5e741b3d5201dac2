"""--train-backend fsdp on a model family (rollout/model/families/: transformers' model with our
router and indexer hooks) in one process (a world-size-1 gloo group): the FSDP2-sharded tiny
GLM-5 (`glm_moe_dsa`, DSA indexer) gives the torch backend's logprobs, replayed choices,
gradient norm and step; its checkpoint round-trips; its HF save loads in transformers and
gives the torch backend's logits. Two ranks: tests/system/test_fsdp_ranks.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.model.families.base import FamilyModel
from replayrl.rollout.sample import Sample
from replayrl.tools.run.from_flags import build_config
from replayrl.trainer.backends.fsdp_backend import FSDPBackend
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.batching.batch import collate
from replayrl.trainer.config import TrainerConfig
from tests.backend_fixtures import (
    assert_fsdp_takes_the_torch_step,
    assert_hf_save_gives_the_logits,
    assert_same_arrays,
    traced_samples,
    train_step,
)
from tests.family_checkpoints import tiny_hf_checkpoint

transformers = pytest.importorskip("transformers", reason="checkpoints are written by transformers")
pytestmark = pytest.mark.usefixtures("one_rank_group")

VOCAB = 97  # tests/family_checkpoints.py


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    directory = tmp_path_factory.mktemp("glm5") / "ckpt"
    tiny_hf_checkpoint("glm_moe_dsa", directory)
    return directory


def _samples(model: FamilyModel) -> list[Sample]:
    """Prompts of 6 tokens, responses of 3..6: more keys than `index_topk` 4, so the indexer
    selects (:func:`tests.backend_fixtures.traced_samples`)."""
    return traced_samples(model, VOCAB, prompt_len=6)


def test_a_sharded_family_policy_takes_the_torch_backends_step(glm5, tmp_path):
    reference = TorchBackend(str(glm5), TrainerConfig(), [])
    fsdp = FSDPBackend(str(glm5), TrainerConfig(train_backend="fsdp"), [])
    assert isinstance(fsdp.model, FamilyModel)
    assert fsdp.parameter_count() == reference.parameter_count()
    batch = collate(_samples(reference.model), routing=True, indexer=True, support=True)
    _, got = assert_fsdp_takes_the_torch_step(reference, fsdp, batch, atol=1e-5, rel=1e-5)
    # the replays ran: wherever the batch holds a trace row, the trainer used it
    traced = (batch.routed_experts >= 0).all(-1)
    assert int(traced.sum()) > 0
    assert torch.equal(got.routed_experts[traced], batch.routed_experts[traced].to(torch.int32))
    before = FamilyModel.from_pretrained(glm5, fsdp.model_config).state_dict()
    weights, expected = fsdp.weights(), reference.weights()
    assert_same_arrays(weights, expected, atol=1e-5, keys=before)
    assert max(float(np.abs(expected[n] - before[n].numpy()).max()) for n in expected) > 1e-4
    # the HF save (gathered) loads in transformers and gives the torch backend's logits
    assert_hf_save_gives_the_logits(fsdp, reference, tmp_path / "out")


def test_a_family_checkpoint_round_trips(glm5, tmp_path):
    config = TrainerConfig(train_backend="fsdp")
    fsdp = FSDPBackend(str(glm5), config, [])
    batch = collate(_samples(fsdp.model), routing=True, indexer=True, support=True)
    train_step(fsdp, batch)
    fsdp.preflight_logprobs(batch)  # a forward with no backward after it, before the save
    saved = fsdp.digest()
    fsdp.save_checkpoint(tmp_path / "ckpt", 2)
    assert FSDPBackend.check_checkpoint(tmp_path / "ckpt", config) == 2
    train_step(fsdp, batch)
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
