"""Context parallelism in the megatron backend (docs/design/megatron.md#context-parallel): the row layout each CP rank
holds, its causal mask, and the settings that refuse impossible layouts naming the flag.

The CP forward itself (logprobs, gradient norm, routing and indexer choices equal to one rank;
``replayrl train --cp-size 2``) runs under torchrun in tests/system/test_megatron_backend.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.tools.errors import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.trainer.backends.megatron_context_parallel import ContextParallel, row_layout
from replayrl.trainer.config import TrainerConfig
from replayrl.trainer.errors import PackingError, TrainerConfigError

SMALL = {"num-steps": 1, "rollout-batch-size": 2, "n-samples-per-prompt": 2}


def _megatron_chunks(width: int, rank: int, cp: int) -> list[int]:
    """Megatron-LM get_batch_on_this_cp_rank, by hand: the row viewed as 2cp chunks, chunks
    rank and 2cp-1-rank."""
    chunks = np.arange(width).reshape(2 * cp, width // (2 * cp))
    return [*chunks[rank], *chunks[2 * cp - 1 - rank]]


@pytest.mark.parametrize("positions,cp,tp,want", [
    (13, 2, 1, 16), (16, 2, 1, 16), (13, 2, 2, 16), (9, 3, 1, 12), (9, 3, 2, 12), (7, 1, 2, 8),
    (7, 1, 1, 7), (1, 4, 1, 8)])
def test_row_width_splits_into_2cp_chunks_and_tp_slices(positions, cp, tp, want):
    # W: the least width >= positions that is a multiple of 2cp (the chunks, when cp > 1) and of cp * tp
    # (each CP rank's positions split evenly over the SP ranks)
    assert row_layout(positions, cp, tp).total_length == want
    assert (cp == 1 or want % (2 * cp) == 0) and (want // cp) % tp == 0
    assert want - positions < 2 * cp * tp


@pytest.mark.parametrize("cp", [2, 3])
def test_ranks_hold_megatrons_load_balanced_chunks(cp):
    width = 24
    held = []
    for rank in range(cp):
        mine = ContextParallel(rank, cp, None, tp_size=1).positions(width)
        assert mine.dtype == torch.int64
        assert mine.tolist() == _megatron_chunks(width, rank, cp)
        held += mine.tolist()
    assert sorted(held) == list(range(width))  # every position on exactly one rank
    x = torch.arange(2 * width).reshape(2, width)
    assert ContextParallel(1, cp, None, 1).shard(x).tolist() == \
        [[r * width + p for p in _megatron_chunks(width, 1, cp)] for r in range(2)]


def test_a_width_that_does_not_split_is_refused_naming_the_padded_one():
    with pytest.raises(PackingError, match="CP row of 13 positions .* pad it to 16"):
        ContextParallel(0, 2, None, tp_size=1).positions(13)
    assert ContextParallel(0, 2, None, tp_size=1).width(13) == 16


def test_causal_mask_masks_the_keys_after_each_local_querys_global_position():
    cp = ContextParallel(0, 2, None, tp_size=1)
    mask = cp.causal_mask(8)  # rank 0 holds positions 0, 1, 6, 7
    assert mask.shape == (1, 1, 4, 8)
    for i, q in enumerate([0, 1, 6, 7]):
        assert mask[0, 0, i].tolist() == [k > q for k in range(8)]


@pytest.mark.parametrize("cp", [2, 3])
def test_indexer_choices_reach_each_cp_ranks_zigzag_queries_rebased_exactly(cp):
    # the indexer's choices are key slots in global positions ([B, W, K], -1 = none); under CP
    # a rank holds the queries of chunks r and 2cp-1-r, so its mask rows must be the choices of
    # exactly those global queries, against the keys put back in global order
    from replayrl.rollout.model.indexer import slots_to_mask

    width, b, k, d = 12, 2, 3, 4
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(width)
    slots = torch.randint(0, width, (b, width, k), generator=g) % (pos[None, :, None] + 1)  # causal
    slots[0, 7, 1:] = -1  # -1 slots select nothing
    slots[1, 10, 0] = -1
    indexer_mask = ~slots_to_mask(slots, width)[:, None]  # [B, 1, W, W], True = masked out
    q, key, v = (torch.randn(width, b, d, generator=g) for _ in range(3))

    def attend(q_rows, q_pos, keys, values, masked):  # naive softmax attention, [n, B, d]
        scores = torch.einsum("qbd,kbd->bqk", q_rows, keys).masked_fill(masked[:, 0], float("-inf"))
        return torch.einsum("bqk,kbd->qbd", scores.softmax(-1), values)

    full_mask = indexer_mask | (pos[None, :] > pos[:, None])[None, None]
    want = attend(q, pos, key, v, full_mask)
    ranks = [ContextParallel(r, cp, None, tp_size=1) for r in range(cp)]
    for r, rank in enumerate(ranks):
        mine = rank.positions(width)
        assert mine.tolist() == _megatron_chunks(width, r, cp)  # the zigzag order
        masked = rank.query_mask(width, indexer_mask)
        assert masked.shape == (b, 1, width // cp, width)
        for i, p in enumerate(mine.tolist()):
            for row in range(b):  # the keys left are exactly the choices of global query p
                chosen = sorted({int(x) for x in slots[row, p] if x >= 0})
                assert (~masked[row, 0, i]).nonzero()[:, 0].tolist() == chosen, (r, p, row)
        keys = rank.unshard([other.shard(key, 0) for other in ranks])  # the gathered keys
        values = rank.unshard([other.shard(v, 0) for other in ranks])
        assert torch.equal(keys, key) and torch.equal(values, v)
        got = attend(rank.shard(q, 0), mine, keys, values, masked)
        torch.testing.assert_close(got, want[mine], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"full-sequence mask \[B, 1, 12, 12\]"):
        ranks[0].query_mask(width, indexer_mask[:, :, :6])


def test_cp_size_needs_the_megatron_backend():
    with pytest.raises(TrainerConfigError, match="--cp-size needs --train-backend megatron"):
        TrainerConfig(cp_size=2)
    with pytest.raises(TrainerConfigError, match="--cp-size must be >= 1"):
        TrainerConfig(train_backend="megatron", cp_size=0)


def test_cp_size_refuses_packed_rows():
    with pytest.raises(TrainerConfigError, match="--cp-size 2 .*--use-packing"):
        TrainerConfig(train_backend="megatron", cp_size=2, use_packing=True)


def test_cp_size_with_pipeline_stages_is_refused():
    # the CP attention is not placed inside megatron's pipeline schedule (docs/design/megatron.md#context-parallel)
    with pytest.raises(TrainerConfigError, match="--cp-size 2 with --pp-size 2"):
        TrainerConfig(train_backend="megatron", cp_size=2, pp_size=2)


def test_ep_size_must_divide_the_ranks_with_cp_counted():
    with pytest.raises(TrainerConfigError, match=r"--ep-size 4 must divide --dp-size x "
                                                 r"--cp-size = 2"):
        TrainerConfig(train_backend="megatron", cp_size=2, ep_size=4)
    assert TrainerConfig(train_backend="megatron", cp_size=2, ep_size=2).ep_size == 2


def test_cp_ranks_are_trainer_ranks_but_not_data_parallel_ranks():
    # trainer processes = dp x tp x pp x cp; the batch splits over --dp-size only (CP peers train
    # the same share), so 2 x 2 = 4 samples over --dp-size 2 with --cp-size 3 are fine
    config = build_config({**SMALL, "train-backend": "megatron", "dp-size": 2, "tp-size": 2,
                           "cp-size": 3})
    assert config.trainer.rank_count == 12
    with pytest.raises(ConfigError, match="--cp-size needs --train-backend megatron"):
        build_config({**SMALL, "cp-size": 2})
