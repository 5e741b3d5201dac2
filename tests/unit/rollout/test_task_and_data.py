"""The embedded task (rollout/tasks/digit_puzzle.py, rollout/tasks/digits.py) and the prompt data
source (rollout/text/data_source.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from replayrl.rollout.errors import TaskError
from replayrl.rollout.tasks.digit_puzzle import DigitTask
from replayrl.rollout.tasks.digits import digit_task_prompts
from replayrl.rollout.text.data_source import PromptDataSource

# The vocabulary written out by hand: <pad> <bos> <eos>, digits 0..9, operators, "=".
PAD, BOS, EOS = 0, 1, 2
DIGIT = {d: 3 + d for d in range(10)}
OP = {"max": 13, "min": 14, "first": 15, "last": 16}
EQ = 17
ID_TO_DIGIT = {v: k for k, v in DIGIT.items()}
ID_TO_OP = {v: k for k, v in OP.items()}


def naive_answer(op: str, digits: list[int]) -> int:
    if op == "max":
        best = digits[0]
        for d in digits:
            best = d if d > best else best
        return best
    if op == "min":
        best = digits[0]
        for d in digits:
            best = d if d < best else best
        return best
    if op == "first":
        return digits[0]
    if op == "last":
        return digits[len(digits) - 1]
    raise AssertionError(op)


# ---------------------------------------------------------------- DigitTask prompts


@pytest.mark.parametrize("num_digits,num_values", [(4, 10), (1, 10), (6, 3)])
def test_prompt_format_and_answer_for_every_operator(num_digits, num_values):
    task = DigitTask(num_digits=num_digits, num_values=num_values)
    rng = np.random.default_rng(123)
    seen_ops = set()
    for _ in range(300):
        ids, answer_id = task.make_prompt(rng)
        assert ids.dtype == np.int32 and ids.shape == (num_digits + 3,)
        ids = ids.tolist()
        assert ids[0] == BOS and ids[-1] == EQ
        op = ID_TO_OP[ids[1]]
        digits = [ID_TO_DIGIT[i] for i in ids[2:-1]]
        assert all(0 <= d < num_values for d in digits)
        assert answer_id == DIGIT[naive_answer(op, digits)]
        seen_ops.add(op)
    assert seen_ops == {"max", "min", "first", "last"}


def test_prompt_uses_only_the_configured_operators():
    task = DigitTask(operators=("min",))
    rng = np.random.default_rng(5)
    for _ in range(50):
        ids, answer_id = task.make_prompt(rng)
        assert ids[1] == OP["min"]
        assert answer_id == DIGIT[min(ID_TO_DIGIT[i] for i in ids[2:-1].tolist())]


def test_special_token_ids_and_decode():
    task = DigitTask()
    assert (task.pad_id, task.bos_id, task.eos_id) == (PAD, BOS, EOS)
    assert task.decode(np.array([BOS, OP["last"], DIGIT[0], DIGIT[9], EQ, EOS])) == "<bos> last 0 9 = <eos>"
    with pytest.raises(TaskError):
        task.decode([10_000])


def test_decode_rejects_negative_ids():
    with pytest.raises(TaskError):
        DigitTask().decode([-1])


@pytest.mark.parametrize("kwargs", [{"num_digits": 0}, {"num_values": 1}, {"num_values": 11},
                                    {"operators": ()}, {"operators": ("max", "sum")}])
def test_bad_task_configuration(kwargs):
    with pytest.raises(TaskError):
        DigitTask(**kwargs)


# ---------------------------------------------------------------- DigitTask reward (answer 7)


@pytest.mark.parametrize("response,expected", [
    ([DIGIT[7], EOS], 1.0),             # exact, stopped
    ([DIGIT[6], EOS], 0.5),             # off by one
    ([DIGIT[8], EOS], 0.5),             # off by one, the other side
    ([DIGIT[9], EOS], 0.25),            # off by two
    ([DIGIT[5], EOS], 0.25),            # off by two, the other side
    ([DIGIT[0], EOS], 0.5 ** 7),        # far off
    ([DIGIT[7]], 0.5),                  # exact, not stopped
    ([DIGIT[7], DIGIT[7]], 0.5),        # exact, continues with a digit
    ([DIGIT[6], DIGIT[1]], 0.25),       # off by one, not stopped
    ([DIGIT[7], EOS, EOS], 0.5),        # does not stop right after the digit
    ([EOS], 0.0),                       # non-digit first token
    ([OP["max"], EOS], 0.0),
    ([EQ, DIGIT[7]], 0.0),
    ([], 0.0),                          # empty
])
def test_reward_by_hand(response, expected):
    got = DigitTask().reward(np.array(response, dtype=np.int32), DIGIT[7])
    assert got == expected


# ---------------------------------------------------------------- PromptDataSource


def indices(batch):
    return [p.index for p in batch]


def test_same_seed_gives_same_prompts_and_order():
    a = PromptDataSource(digit_task_prompts(DigitTask(), 3, 64), seed=3)
    b = PromptDataSource(digit_task_prompts(DigitTask(), 3, 64), seed=3)
    for pa, pb in zip(a.prompts, b.prompts):
        assert np.array_equal(pa.prompt_ids, pb.prompt_ids) and pa.answer_id == pb.answer_id
    for n in (5, 40, 30):
        assert indices(a.next_batch(n)) == indices(b.next_batch(n))


def test_different_seeds_give_different_prompts_and_order():
    a = PromptDataSource(digit_task_prompts(DigitTask(), 3, 64), seed=3)
    b = PromptDataSource(digit_task_prompts(DigitTask(), 4, 64), seed=4)
    assert any(not np.array_equal(pa.prompt_ids, pb.prompt_ids) for pa, pb in zip(a.prompts, b.prompts))
    assert indices(a.next_batch(64)) != indices(b.next_batch(64))


def test_prompts_are_valid_read_only_and_indexed():
    src = PromptDataSource(digit_task_prompts(DigitTask(num_digits=3), 0, 20), seed=0)
    for i, p in enumerate(src.prompts):
        assert p.index == i
        assert not p.prompt_ids.flags.writeable
        ids = p.prompt_ids.tolist()
        assert p.answer_id == DIGIT[naive_answer(ID_TO_OP[ids[1]], [ID_TO_DIGIT[t] for t in ids[2:-1]])]


def test_every_prompt_is_visited_exactly_once_per_epoch():
    n = 13
    src = PromptDataSource(digit_task_prompts(DigitTask(), 9, n), seed=9)
    orders = []
    for _ in range(3):
        epoch = []
        for size in (4, 4, 5):  # 13 per epoch in uneven batches
            epoch += indices(src.next_batch(size))
        assert sorted(epoch) == list(range(n))
        orders.append(epoch)
    assert src.epoch == 2 and src.cursor == n
    assert len({tuple(o) for o in orders}) == 3  # reshuffled every epoch


def test_batch_crossing_the_epoch_boundary_is_filled_from_the_next_epoch():
    n = 5
    ref = PromptDataSource(digit_task_prompts(DigitTask(), 11, n), seed=11)
    epoch0, epoch1 = indices(ref.next_batch(n)), indices(ref.next_batch(n))

    src = PromptDataSource(digit_task_prompts(DigitTask(), 11, n), seed=11)
    assert indices(src.next_batch(3)) == epoch0[:3]
    crossing = src.next_batch(4)
    assert len(crossing) == 4
    assert indices(crossing) == epoch0[3:] + epoch1[:2]
    assert src.state_dict() == {"epoch": 1, "cursor": 2}


def test_batch_larger_than_the_dataset_spans_several_epochs():
    src = PromptDataSource(digit_task_prompts(DigitTask(), 2, 3), seed=2)
    batch = indices(src.next_batch(7))
    assert len(batch) == 7
    assert sorted(batch[:3]) == sorted(batch[3:6]) == [0, 1, 2]
    assert src.state_dict() == {"epoch": 2, "cursor": 1}


@pytest.mark.parametrize("first", [0, 2, 5, 7, 10])
def test_resume_from_state_dict_gives_the_same_next_batch(first):
    n = 5
    uninterrupted = PromptDataSource(digit_task_prompts(DigitTask(), 21, n), seed=21)
    uninterrupted.next_batch(first)
    state = json.loads(json.dumps(uninterrupted.state_dict()))  # survives a checkpoint file

    resumed = PromptDataSource(digit_task_prompts(DigitTask(), 21, n), seed=21)
    resumed.next_batch(3)  # a different position, overwritten by the load
    resumed.load_state_dict(state)
    for size in (4, 6):
        assert indices(resumed.next_batch(size)) == indices(uninterrupted.next_batch(size))


def test_zero_and_negative_batch_sizes():
    src = PromptDataSource(digit_task_prompts(DigitTask(), 0, 4), seed=0)
    assert src.next_batch(0) == []
    assert src.state_dict() == {"epoch": 0, "cursor": 0}
    with pytest.raises(ValueError):
        src.next_batch(-1)
    with pytest.raises(ValueError):
        PromptDataSource(digit_task_prompts(DigitTask(), 0, 0), seed=0)


def test_observation_segments_count_tool_calls_by_hand():
    from replayrl.rollout.dispatch.manager import observation_segments
    assert observation_segments(np.array([1, 1, 0, 0, 1, 0, 0, 1], np.uint8)) == 2
    assert observation_segments(np.array([0, 1], np.uint8)) == 1
    assert observation_segments(np.array([1, 1], np.uint8)) == 0
    assert observation_segments(np.array([], np.uint8)) == 0
