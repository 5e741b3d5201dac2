"""Trainer data parallelism (docs/design/trainer-ranks.md#trainer-ranks): --dp-size N trainer processes,
torch DDP over gloo, against the one-rank trainer as the reference."""
from __future__ import annotations

import tempfile

import numpy as np
import pytest

from replayrl.actors import Directory, Supervisor
from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import actor_specs, write_initial_checkpoint
from replayrl.trainer.errors import RankGroupError
from replayrl.trainer.ranks.rank_group import RankGroup, follower_names, shard, shard_bounds
from tests.rank_checks import assert_same_step_metrics, assert_same_update

SMALL = {"rollout-batch-size": 2, "n-samples-per-prompt": 2, "progress": False}


# ---- the split ------------------------------------------------------------------------------
def test_shares_are_contiguous_and_cover_the_batch():
    assert shard_bounds(8, 2, exact=True) == [(0, 4), (4, 8)]
    assert shard(list("abcdef"), 3, exact=True) == [["a", "b"], ["c", "d"], ["e", "f"]]
    # a preflight may be uneven: the first count % dp ranks take one more
    assert shard_bounds(5, 2, exact=False) == [(0, 3), (3, 5)]
    assert shard_bounds(1, 3, exact=False) == [(0, 1), (1, 1), (1, 1)]


def test_a_training_batch_that_does_not_split_evenly_is_refused():
    with pytest.raises(RankGroupError, match="6 samples do not split evenly|--dp-size 4"):
        shard_bounds(6, 4, exact=True)


def test_the_run_config_refuses_a_batch_that_does_not_split_over_the_ranks():
    with pytest.raises(ConfigError, match="do not split evenly over --dp-size 3"):
        build_config({**SMALL, "dp-size": 3})  # 2 x 2 = 4 samples
    assert build_config({**SMALL, "dp-size": 4}).trainer.dp_size == 4


def test_pipeline_layouts_that_cannot_run_are_refused_naming_the_flag(tmp_path):
    # docs/design/megatron.md#pipeline-parallel: stages hold equal layer ranges (the embedded default has 4 layers),
    # pipelines are megatron's, the interleaved (VPP) schedule is not offered
    with pytest.raises(ConfigError, match=r"--pp-size 3 must divide the policy's 4 layers"):
        build_config({**SMALL, "train-backend": "megatron", "pp-size": 3})
    with pytest.raises(ConfigError, match=r"--tp-size / --ep-size / --pp-size need --train-backend megatron"):
        build_config({**SMALL, "pp-size": 2})
    with pytest.raises(ConfigError, match=r"--vpp-size"):
        build_config({**SMALL, "train-backend": "megatron", "pp-size": 2, "vpp-size": 2})
    # trainer ranks = dp x tp x pp: rank 0 (stage 0) leads, trainer_1 holds stage 1
    config = build_config({**SMALL, "train-backend": "megatron", "pp-size": 2,
                           "output-dir": str(tmp_path)})
    names = [s.name for s in actor_specs(config, tmp_path / "ckpt", rank_port=29999)]
    assert [n for n in names if n.startswith("trainer")] == ["trainer", "trainer_1"]


def test_megatron_layouts_the_model_cannot_split_into_are_refused_before_start():
    # the embedded policy (rollout/model/config.py default_config): vocabulary 44, 4 query
    # heads, 2 KV heads, dense width 256, 8 experts of width 64 -- megatron-core would fail on
    # these inside its constructors, after every actor started
    megatron = {**SMALL, "train-backend": "megatron"}
    with pytest.raises(ConfigError, match=r"vocab_size=44 is not a multiple of --tp-size 3"):
        build_config({**megatron, "tp-size": 3})
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2 is not a multiple of --tp-size 4"):
        build_config({**megatron, "tp-size": 4})
    with pytest.raises(ConfigError, match=r"num_experts=8 is not a multiple of --ep-size 16"):
        build_config({**megatron, "dp-size": 4, "ep-size": 16,
                      "rollout-batch-size": 16, "n-samples-per-prompt": 4, "cp-size": 4})
    # expert layers take --tp-size x --ep-size ranks of a stage: EP comes from DP x CP
    with pytest.raises(ConfigError, match=r"--ep-size 2 must divide --dp-size x --cp-size = 1"):
        build_config({**megatron, "tp-size": 2, "ep-size": 2})
    with pytest.raises(ConfigError, match=r"--ep-size 4 must divide --dp-size x --cp-size = 2"):
        build_config({**megatron, "tp-size": 2, "dp-size": 2, "ep-size": 4})
    assert build_config({**megatron, "tp-size": 2, "dp-size": 2, "ep-size": 2}).trainer.ep_size == 2
    with pytest.raises(ConfigError, match=r"--use-packing is not supported by --train-backend megatron"):
        build_config({**megatron, "use-packing": True})


def test_rank_group_fields_are_checked():
    with pytest.raises(RankGroupError, match="rank"):
        RankGroup(rank=2, size=2, host="127.0.0.1", port=1234)
    with pytest.raises(RankGroupError, match="port"):
        RankGroup(rank=0, size=2, host="127.0.0.1", port=0)
    assert follower_names(3) == ["trainer_1", "trainer_2"]


def test_the_launcher_starts_one_process_per_trainer_rank(tmp_path):
    config = build_config({**SMALL, "dp-size": 2, "output-dir": str(tmp_path)})
    specs = actor_specs(config, tmp_path / "ckpt", rank_port=29999)
    by_name = {s.name: s for s in specs}
    assert by_name["trainer"].kwargs["ranks"] == {"size": 2, "host": "127.0.0.1", "port": 29999}
    assert by_name["trainer_1"].cls == "replayrl.trainer.ranks.trainer_rank:TrainerRank"
    assert by_name["trainer_1"].kwargs["group"]["rank"] == 1
    one = actor_specs(build_config({**SMALL, "output-dir": str(tmp_path)}), tmp_path / "ckpt")
    # one rank: no extra process and no group
    assert [s.name for s in one if s.name.startswith("trainer")] == ["trainer"]
    assert next(s for s in one if s.name == "trainer").kwargs["ranks"] is None


# ---- the real processes -----------------------------------------------------------------------
async def _one_step(tmp_path, extra: dict) -> tuple[dict, dict[str, dict]]:
    """Push, generate rollout 0, train one step; the metrics row and every trainer rank's
    weights / optimizer digest."""
    config = build_config({**SMALL, "num-steps": 1, "output-dir": str(tmp_path), **extra})
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
            digests = {name: await directory.ref(name).call("weights_digest") for name in ranks}
    digests["before"] = before
    return row, digests


def _arrays(digest: dict) -> dict[str, np.ndarray]:
    return {k: np.frombuffer(v, dtype=np.float32) for k, v in digest.items()}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    import asyncio

    return asyncio.run(_one_step(tmp_path_factory.mktemp("dp1"), {}))


@pytest.mark.parametrize("extra", [{}, {"preflight": "always"}],
                         ids=["fused-forward", "separate-preflight"])
async def test_two_ranks_take_the_same_step_as_one(tmp_path, one_rank, extra):
    reference_row, reference = one_rank
    row, digests = await _one_step(tmp_path, {"dp-size": 2, **extra})
    # the same batch, split in two: same token counts, same loss, same gradient up to the
    # order of the float sums
    assert_same_step_metrics(row, reference_row)
    one, two, start = _arrays(reference["trainer"]), _arrays(digests["trainer"]), _arrays(digests["before"])
    assert_same_update(one, two, start, build_config(SMALL).trainer.lr)
    # DDP replicas: rank 1 holds bit for bit what rank 0 holds
    assert digests["trainer_1"] == digests["trainer"]


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
async def test_exact_refill_over_two_ranks_requests_whole_quanta(tmp_path, backend):
    # n = 3 samples per group over 2 data-parallel ranks: the quantum is q = 2 / gcd(2, 3) = 2
    # groups (6 samples, 3 per rank), so every replacement batch splits evenly
    # (docs/design/rejection-sampling.md#exact-refill, docs/design/trainer-ranks.md#trainer-ranks);
    # the steps train exactly --rollout-batch-size groups. The fsdp backend's forwards are
    # collectives: its preflights must split exactly, and do (docs/trainer-ranks.md#fsdp)
    from replayrl.tools.run.launcher import launch

    config = build_config({"rollout-batch-size": 2, "n-samples-per-prompt": 3, "progress": False,
                           "dp-size": 2, "num-steps": 2, "output-dir": str(tmp_path),
                           "train-backend": backend,
                           "rs-mode": "geometric", "rs-lower": 0.97, "rs-upper": 1.03,
                           "rs-batch-refill": True, "rs-refill-max-rounds": 8})
    rows = (await launch(config)).rows
    assert [r["trained_groups"] for r in rows] == [2, 2]
    replacement_rounds = [d for r in rows for d in r["refill_round_detail"] if d["round"] > 0]
    assert replacement_rounds, "the band must reject something for the test to mean anything"
    assert all(d["candidate_groups"] % 2 == 0 for d in replacement_rounds)
