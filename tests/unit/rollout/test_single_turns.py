"""A batch of single-turn episodes assembled as columns agrees with ``merge_turns``, the
per-trajectory assembly, on every batch: the same arrays for a good one, and for a bad one no
columns, so the caller's per-trajectory assembly raises its error naming the sample and field.
The reference is ``merge_turns`` itself, run one trajectory at a time."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.dispatch.manager import RolloutManager
from replayrl.rollout.engines.base import Generation
from replayrl.rollout.episodes.single_turns import single_turn_columns
from replayrl.rollout.episodes.turn_loop import Episode, assemble
from replayrl.rollout.errors import CaptureError, MissingTraceError, SampleError, TraceSchemaError, TrajectoryError
from replayrl.rollout.sample import TRACE_FIELDS, unpack_rows
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY, DigitTask
from replayrl.rollout.text.data_source import Prompt
from replayrl.rollout.traces.trajectory import merge_turns
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint

TOKENS = ("response_ids", "loss_mask", "rollout_logprobs")


def _episode(rng: np.random.Generator, traces: bool = True, version: int = 3,
             width: int = 3) -> Episode:
    P, R = int(rng.integers(1, 7)), int(rng.integers(1, 6))
    ids = rng.integers(0, 40, R).astype(np.int32)
    support = None
    if traces:  # column 0 the sampled id, a candidate in column 1, -1 (removed) after
        support = np.full((R, 1 + width), -1, np.int32)
        support[:, 0] = support[:, 1] = ids
    positions = P + R - 1
    gen = Generation(
        response_ids=ids, rollout_logprobs=-rng.random(R, dtype=np.float32),
        finish_reason=str(rng.choice(["stop", "length"])), sample_support=support,
        routed_experts=rng.integers(0, 8, (positions, 2, 2)).astype(np.int32) if traces else None,
        indexer_topk=rng.integers(-1, positions, (positions, 1, 4)).astype(np.int32) if traces else None)
    prompt = tuple(int(t) for t in rng.integers(0, 40, P))
    return Episode(prompt, (gen,), (), (version,), gen.finish_reason, 0)


def _batch(seed: int, n: int = 9, **kw) -> list[Episode]:
    rng = np.random.default_rng(seed)
    return [_episode(rng, **kw) for _ in range(n)]


def _with_turn(episode: Episode, **changes) -> Episode:
    return dataclasses.replace(episode, turns=(dataclasses.replace(episode.turns[0], **changes),))


@pytest.mark.parametrize("traces", [True, False])
def test_columns_hold_what_merge_turns_gives_each_trajectory(traces):
    episodes = _batch(0, traces=traces)
    columns = single_turn_columns(episodes, ())
    P, R = columns["prompt_lengths"], columns["response_lengths"]
    assert P.tolist() == [len(e.prompt_ids) for e in episodes]
    prompts = unpack_rows(columns["prompt_ids"], P)
    fields = {name: unpack_rows(columns[name], R) for name in TOKENS}
    rows = {name: unpack_rows(columns[name], R if name == "sample_support" else P + R - 1)
            for name in TRACE_FIELDS}
    for i, e in enumerate(episodes):
        merged = merge_turns(e.prompt_ids, e.turns, e.observations, sample_id=i)
        assert prompts[i].tolist() == list(e.prompt_ids) and prompts[i].dtype == np.int32
        for name in TOKENS:
            want = getattr(merged, name)
            assert fields[name][i].dtype == want.dtype and np.array_equal(fields[name][i], want)
        for name in TRACE_FIELDS:
            want = getattr(merged, name)
            if not traces:
                assert want is None and columns[name] is None
                continue
            assert rows[name][i].dtype == want.dtype and np.array_equal(rows[name][i], want)
    assert columns["policy_version"].tolist() == [3] * len(episodes)
    for value in columns.values():
        assert value is None or not value.flags.writeable  # samples take them as views


def _negative_id(e):
    ids = np.array(e.turns[0].response_ids)
    ids[0] = -1
    return _with_turn(e, response_ids=ids)


def _nan_logprob(e):
    lp = np.array(e.turns[0].rollout_logprobs)
    lp[-1] = np.nan
    return _with_turn(e, rollout_logprobs=lp)


def _support_column_zero(e):
    support = np.array(e.turns[0].sample_support)
    support[0, 0] += 1
    return _with_turn(e, sample_support=support)


def _trace_below_minus_one(e):
    routing = np.array(e.turns[0].routed_experts)
    routing[0, 0, 0] = -2
    return _with_turn(e, routed_experts=routing)


def _routing_row_short(e):
    return _with_turn(e, routed_experts=e.turns[0].routed_experts[1:])


def _float_response(e):
    return _with_turn(e, response_ids=e.turns[0].response_ids.astype(np.float32))


def _big_id(e):
    ids = np.array(e.turns[0].response_ids, dtype=np.int64)
    ids[0] = 2 ** 31  # int32 would wrap it into another token
    return _with_turn(e, response_ids=ids)


def _uint64_id(e):
    # numpy concatenates uint64 with int32 as float64; merge_turns refuses the id past int32
    return _with_turn(e, response_ids=np.array([2 ** 32 + 5], np.uint64),
                      rollout_logprobs=np.array([-0.5]), sample_support=None, routed_experts=None,
                      indexer_topk=None)


def _big_prompt_id(e):
    return dataclasses.replace(e, prompt_ids=(*e.prompt_ids[:-1], 2 ** 31))


def _ragged_logprobs(e):
    return _with_turn(e, rollout_logprobs=[[-0.5], [-0.5, -0.1]])


def _empty_support(e):
    return _with_turn(e, sample_support=np.zeros((len(e.turns[0].response_ids), 0), np.int32))


# (mutation of the batch's fifth episode, the error merge_turns raises for it)
BAD = [(_negative_id, TrajectoryError), (_nan_logprob, CaptureError),
       (_support_column_zero, TrajectoryError), (_trace_below_minus_one, TraceSchemaError),
       (_routing_row_short, TrajectoryError), (_float_response, TrajectoryError),
       (_big_id, TrajectoryError), (_big_prompt_id, TrajectoryError),
       (_ragged_logprobs, TrajectoryError), (_empty_support, TrajectoryError)]


@pytest.mark.parametrize("mutate, error", BAD, ids=[m.__name__ for m, _ in BAD])
def test_a_bad_trajectory_gives_no_columns_and_its_own_assembly_names_it(mutate, error):
    episodes = _batch(1)
    episodes[4] = mutate(episodes[4])
    assert single_turn_columns(episodes, ()) is None
    with pytest.raises(error) as raised:
        assemble(episodes[4], sample_id=4, require=())
    assert raised.value.sample_id == 4


def test_a_required_trace_missing_gives_no_columns():
    episodes = _batch(2, traces=False)
    assert single_turn_columns(episodes, ()) is not None
    assert single_turn_columns(episodes, ("routed_experts",)) is None
    with pytest.raises(MissingTraceError):
        assemble(episodes[0], sample_id=0, require=("routed_experts",))
    assert single_turn_columns(episodes, ("no_such_trace",)) is None  # merge_turns refuses it


def test_batches_merge_turns_takes_but_columns_cannot_go_back_whole():
    rng = np.random.default_rng(3)
    wide = _batch(3)
    wide[2] = _episode(rng, width=5)  # another support width: one trajectory each, not one column
    partial = _batch(3)
    partial[0] = _episode(rng, traces=False)  # a trace some trajectories lack
    two_turns = _batch(3, traces=False)
    first = two_turns[0]
    two_turns[1] = Episode(first.prompt_ids, (first.turns[0], first.turns[0]),
                           (np.array([5], np.int32),), (3, 3), "stop", 1)
    for episodes in (wide, partial, two_turns):
        assert single_turn_columns(episodes, ()) is None
        for i, e in enumerate(episodes):
            assemble(e, sample_id=i, require=())  # each one is fine on its own


@pytest.fixture
def manager(tmp_path):
    checkpoint = write_initial_checkpoint(build_config({}), tmp_path / "ckpt")  # its tokenizer

    def build(**settings):
        cfg = RolloutConfig(**settings)
        return RolloutManager(cfg.to_dict(), ["engine_0"], [], 256, str(checkpoint),
                              len(VOCABULARY))
    return build


def _digit_batch(seed: int, n: int) -> tuple[list[tuple[int, Episode]], list[Prompt]]:
    """``n`` single-turn digit-task episodes over ``n // 2`` prompts (two per group)."""
    rng = np.random.default_rng(seed)
    task = DigitTask()
    prompts = [Prompt(g, np.array([task.bos_id, *rng.integers(4, 14, 3), VOCABULARY.index("=")],
                                  np.int32), int(rng.integers(4, 14))) for g in range(n // 2)]
    ordered = []
    for k in range(n):
        g = k // 2
        R = int(rng.integers(1, 4))
        ids = rng.integers(0, len(VOCABULARY), R).astype(np.int32)
        gen = Generation(response_ids=ids, rollout_logprobs=-rng.random(R, dtype=np.float32),
                         finish_reason="stop" if ids[-1] == task.eos_id else "length")
        ordered.append((g, Episode(tuple(prompts[g].prompt_ids.tolist()), (gen,), (), (1,),
                                   gen.finish_reason, 0)))
    return ordered, prompts


async def test_the_manager_builds_the_same_samples_either_way(manager):
    ordered, prompts = _digit_batch(4, 12)
    columns_side, each_side = manager(), manager()
    columns = columns_side._single_turn_columns([e for _, e in ordered])
    assert columns is not None
    group_ids = [10 + g for g in range(len(prompts))]
    fast, fast_verified = await columns_side._assemble_columns(columns, ordered, prompts,
                                                               group_ids, 7)
    slow, slow_verified = await each_side._assemble_each(ordered, prompts, group_ids, 7)
    assert fast_verified == slow_verified
    assert columns_side.next_sample_id == each_side.next_sample_id == len(ordered)
    assert len({s.reward for s in slow}) > 1  # the batch tells rewards apart
    for a, b in zip(fast, slow, strict=True):
        for f in dataclasses.fields(b):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(y, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y), f.name
                assert not x.flags.writeable
            else:
                assert x == y, f.name


def test_a_trajectory_owed_a_synthetic_eos_goes_back_to_its_own_assembly(manager):
    ordered, _ = _digit_batch(5, 6)
    episodes = [e for _, e in ordered]
    capped = [e.finish_reason == "length" for e in episodes]
    assert any(capped)
    assert manager()._single_turn_columns(episodes) is not None
    assert manager(append_eos_on_truncation=True)._single_turn_columns(episodes) is None
    # a capped response that happens to end with a sampled EOS gets none
    eos = DigitTask().eos_id
    ending = [_with_turn(e, response_ids=np.append(e.turns[0].response_ids[:-1], eos).astype(np.int32))
              for e in episodes]
    assert manager(append_eos_on_truncation=True)._single_turn_columns(ending) is not None


def test_mixed_dtypes_a_version_or_route_start_that_is_not_an_int_give_no_columns():
    episodes = _batch(8, traces=False)
    mixed = list(episodes)
    mixed[1] = _uint64_id(mixed[1])
    assert single_turn_columns(mixed, ()) is None
    with pytest.raises(TrajectoryError, match="does not fit int32"):
        assemble(mixed[1], sample_id=1, require=())
    # int64 next to int32 ids: concatenated exactly
    wide = [_with_turn(e, response_ids=e.turns[0].response_ids.astype(np.int64)) if k % 2 else e
            for k, e in enumerate(episodes)]
    columns = single_turn_columns(wide, ())
    assert columns["response_ids"].dtype == np.int32
    assert columns["response_ids"].tolist() == [int(t) for e in episodes for t in e.turns[0].response_ids]
    for odd in (dataclasses.replace(episodes[0], versions=(3.0,)),
                dataclasses.replace(episodes[0], versions=(True,))):
        assert single_turn_columns([odd, *episodes[1:]], ()) is None
    turn = episodes[0].turns[0]
    object.__setattr__(turn, "route_start", 0.0)  # a float 0 is not the int merge_turns takes
    assert single_turn_columns(episodes, ()) is None


async def test_a_contract_break_goes_back_before_any_reward_runs(manager):
    """A support row with no candidate left passes the assembly checks but not the contract:
    the batch is assembled episode by episode, which names the sample before scoring any later
    trajectory (a later reward that raises never runs)."""
    rng = np.random.default_rng(6)
    episodes = [_episode(rng) for _ in range(4)]
    support = np.array(episodes[2].turns[0].sample_support)
    support[0, 1:] = -1
    episodes[2] = _with_turn(episodes[2], sample_support=support)
    assert single_turn_columns(episodes, ()) is not None
    m = manager()
    assert m._single_turn_columns(episodes) is None
    scored = []

    async def reward(fields, prompt, episode):
        scored.append(fields["sample_id"])
        return 0.5, 0.5

    m._episode_reward = reward
    prompts = [Prompt(i, np.array(e.prompt_ids, np.int32), 4) for i, e in enumerate(episodes)]
    with pytest.raises(SampleError) as raised:
        await m._assemble_each(list(enumerate(episodes)), prompts, [0, 1, 2, 3], 0)
    assert (raised.value.sample_id, raised.value.field) == (2, "sample_support")
    assert scored == [0, 1, 2]


async def test_a_non_finite_reward_is_named_before_the_next_trajectory_is_scored(manager):
    ordered, prompts = _digit_batch(9, 6)
    m = manager()
    columns = m._single_turn_columns([e for _, e in ordered])
    scored = []

    async def reward(fields, prompt, episode):
        scored.append(fields["sample_id"])
        return (float("nan") if len(scored) == 2 else 0.5), None

    m._episode_reward = reward
    with pytest.raises(SampleError) as raised:
        await m._assemble_columns(columns, ordered, prompts, [0, 1, 2], 0)
    assert (raised.value.sample_id, raised.value.field) == (1, "reward")
    assert str(raised.value).endswith("not finite: nan")
    assert scored == [0, 1]
