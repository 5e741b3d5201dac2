"""--train-backend fsdp over --dp-size ranks (docs/trainer-ranks.md#fsdp): one step of the
embedded Qwen3-MoE with its DSA indexer (R3, indexer and support replay) at DP=2 against DP=1,
the weights pushed once by rank 0, gathered from the two ranks' shards; the same for a tiny
GLM-5 (`glm_moe_dsa`: transformers' model with our router / indexer hooks, a DSA family)."""
from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import numpy as np
import pytest

from replayrl.actors import Directory, Supervisor
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import actor_specs, tokenizer_dir, write_embedded_tokenizer, write_initial_checkpoint
from replayrl.trainer.ranks.rank_group import follower_names
from tests.family_checkpoints import tiny_hf_checkpoint
from tests.rank_checks import assert_same_step_metrics, assert_same_update

SMALL = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "progress": False,
         "train-backend": "fsdp"}


async def _one_step(tmp_path, extra: dict) -> tuple[dict, dict, dict[str, dict]]:
    """Push, generate rollout 0, train one step, push again; the metrics row, the second push's
    result and every trainer rank's digest (its shards)."""
    config = build_config({**SMALL, "num-steps": 1, "output-dir": str(tmp_path), **extra})
    if config.hf_checkpoint:  # on the built-in task: the embedded tokenizer beside it, as the launcher
        checkpoint = Path(config.hf_checkpoint)
        write_embedded_tokenizer(tokenizer_dir(config, checkpoint))
    else:
        checkpoint = write_initial_checkpoint(config, tmp_path / "ckpt")
    specs = actor_specs(config, checkpoint)
    ranks = ["trainer", *follower_names(config.trainer.dp_size)]
    with tempfile.TemporaryDirectory(prefix="rrl-") as run_dir:
        directory = Directory.for_run(run_dir, [s.name for s in specs])
        async with Supervisor(specs, directory, run_dir):
            trainer = directory.ref("trainer")
            await trainer.call("push_weights")
            before = await trainer.call("weights_digest")
            await directory.ref("rollout_manager").call("generate", 0)
            row = await trainer.call("train", 0)
            push = await trainer.call("push_weights")
            digests = {name: await directory.ref(name).call("weights_digest") for name in ranks}
    digests["before"] = before
    return row, push, digests


def _full(digests: list[dict]) -> dict[str, np.ndarray]:
    """The full tensors (flat float32) from the ranks' shards: FSDP2 cuts dim 0 in rank order,
    so the row-major bytes of the shards, concatenated, are the tensor's."""
    return {k: np.frombuffer(b"".join(d[k] for d in digests), dtype=np.float32)
            for k in digests[0]}


def _assert_replayed_step_as_one(row: dict, reference_row: dict) -> None:
    """The one-rank step's metrics (tests/rank_checks.py), and the replays ran: the trainer used
    the engine's experts and indexer keys everywhere (flip rates 0 on both)."""
    assert_same_step_metrics(row, reference_row)
    for key in ("routing_flip_rate", "indexer_flip_rate"):
        assert row[key] == reference_row[key] == 0.0


def _assert_pushed_whole_once(push: dict, reference_push: dict, two: dict[str, np.ndarray]) -> None:
    """Rank 0 pushed the whole weight set once (version 1), gathered from both ranks' shards:
    as many bytes as the full tensors ``two`` of every weight, as the one-rank push did."""
    full_bytes = sum(a.nbytes for k, a in two.items() if k.startswith("param/"))
    assert push == {**push, "version": 1, "bytes": full_bytes}
    assert reference_push["bytes"] == full_bytes


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return asyncio.run(_one_step(tmp_path_factory.mktemp("fsdp1"), {}))


@pytest.mark.parametrize("extra", [{}, {"preflight": "always"}],
                         ids=["fused-forward", "separate-preflight"])
async def test_two_fsdp_ranks_take_the_same_step_as_one(tmp_path, one_rank, extra):
    reference_row, reference_push, reference = one_rank
    row, push, digests = await _one_step(tmp_path, {"dp-size": 2, **extra})
    _assert_replayed_step_as_one(row, reference_row)
    two = _full([digests["trainer"], digests["trainer_1"]])
    # each rank holds a part: neither's shard of a weight is the whole tensor
    assert len(digests["trainer"]["param/model.embed_tokens.weight"]) < \
        len(reference["trainer"]["param/model.embed_tokens.weight"])
    assert_same_update(_full([reference["trainer"]]), two, _full([reference["before"]]), build_config(SMALL).trainer.lr)
    _assert_pushed_whole_once(push, reference_push, two)


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    """A tiny random GLM-5 checkpoint (tests/family_checkpoints.py) and its one-rank step."""
    pytest.importorskip("transformers", reason="checkpoints are written by transformers")
    directory = tmp_path_factory.mktemp("glm5")
    tiny_hf_checkpoint("glm_moe_dsa", directory / "ckpt")
    extra = {"hf-checkpoint": str(directory / "ckpt")}
    return extra, asyncio.run(_one_step(directory / "dp1", extra))


async def test_two_fsdp_ranks_take_one_ranks_step_on_a_dsa_family(tmp_path, glm5):
    extra, (reference_row, reference_push, reference) = glm5
    row, push, digests = await _one_step(tmp_path, {**extra, "dp-size": 2})
    _assert_replayed_step_as_one(row, reference_row)
    one = _full([reference["trainer"]])
    # a buffer (the routers' e_score_correction_bias) is not sharded: whole on every rank
    ranks = [digests["trainer"], digests["trainer_1"]]
    buffers = {k for k in one if all(len(d[k]) == len(reference["trainer"][k]) for d in ranks)}
    assert any("e_score_correction_bias" in k for k in buffers)
    assert all(ranks[0][k] == ranks[1][k] for k in buffers)
    two = {**_full(ranks), **_full([{k: ranks[0][k] for k in buffers}])}
    assert len(digests["trainer"]["param/model.embed_tokens.weight"]) < \
        len(reference["trainer"]["param/model.embed_tokens.weight"])
    assert_same_update(one, two, _full([reference["before"]]), build_config(SMALL).trainer.lr)
    _assert_pushed_whole_once(push, reference_push, two)
