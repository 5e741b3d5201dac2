"""The sort task (``--task sort``, rollout/tasks/sort.py): its reward by hand, its seeded
prompts, its registry line, the refusal of settings it cannot run with, and one in-process
training step through it (a real EngineActor, RolloutManager and TrainerActor joined by fake
proxies, tests/step_rig.py, as tests/unit/rollout/test_task_room.py does for the fake task).

Expected values are computed here independently of the task's code: digit token ids from the
embedded vocabulary's order, answers by sorting the prompt's digits, rewards by counting
matching positions in a plain loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.tasks import TASKS, make_task, task_class_path
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.rollout.tasks.sort import SortTask, position_reward, sort_rows
from replayrl.rollout.text.tokenizer import load_tokenizer
from replayrl.tools.run.config import ConfigError
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_embedded_tokenizer, write_initial_checkpoint
from tests.step_rig import step_rig

# the embedded vocabulary, by hand: <pad> <bos> <eos> then the digits 0-9 at ids 3-12
BOS, EOS, EQUALS = 1, 2, VOCABULARY.index("=")


def digit(d: int) -> int:
    return 3 + d


def by_hand(prompt_ids, response_ids) -> float:
    """The reward the sort task's docstring defines, counted position by position."""
    digits = [int(i) - 3 for i in prompt_ids[1:-1]]
    answer = [digit(d) for d in sorted(digits)] + [EOS]
    right = sum(1 for i, want in enumerate(answer)
                if i < len(response_ids) and int(response_ids[i]) == want)
    return right / len(answer)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_embedded_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("response, expected", [
    ([digit(1), digit(2), digit(3), EOS], 1.0),          # all 4 positions
    ([digit(1), digit(3), digit(3), EOS], 3 / 4),        # one digit wrong
    ([digit(1), digit(2), EOS], 2 / 4),                  # early EOS: wrong there, rest missing
    ([digit(1), digit(2), digit(3), digit(4)], 3 / 4),   # no EOS at position 3
    ([digit(3), digit(2), digit(1), EOS], 2 / 4),        # reversed: middle digit and EOS right
    ([], 0.0),
    ([EOS], 0.0),
])
def test_position_reward_by_hand(response, expected):
    """answer "1 2 3" then EOS: L = 4 positions."""
    got = position_reward(np.asarray(response, dtype=np.int32),
                          np.asarray([digit(1), digit(2), digit(3)]), (EOS,))
    assert got == pytest.approx(expected)


def test_the_task_scores_the_final_segment_with_the_tokenizers_eos(tokenizer):
    task = SortTask(RolloutConfig(task="sort", answer_tokens=3, max_response_len=4,
                                  dataset_size=20))
    prompts = task.prompts(tokenizer, vocab_size=len(VOCABULARY), max_prompt_len=200).train
    for prompt in prompts:
        answer = [digit(int(d)) for d in prompt.label.split()]
        for response in (answer + [EOS], answer[:2] + [EOS], [answer[0], 0, answer[2], EOS]):
            ids = np.asarray(response, dtype=np.int32)
            call = task.reward(tokenizer, prompt, ids, np.ones(len(ids), np.uint8))
            assert call.bounded
            assert call.fn(*call.args) == pytest.approx(by_hand(prompt.prompt_ids, response))
    assert len(prompts) == 20


def test_prompts_are_seeded_and_their_labels_are_the_sorted_digits(tokenizer):
    a, b, other = (sort_rows(s, 12, 4, 50) for s in (1, 1, 2))
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in other]
    for row in a:
        words = row.prompt.split()
        assert words[0] == "<bos>" and words[-1] == "=" and len(words) == 14
        assert all(w in "0123" for w in words[1:-1])
        assert row.label.split() == sorted(words[1:-1])
    cfg = RolloutConfig(task="sort", answer_tokens=12, num_values=4, dataset_size=50,
                        max_response_len=13)
    made = make_task(cfg).prompts(tokenizer, vocab_size=len(VOCABULARY), max_prompt_len=200)
    for row, prompt in zip(a, made.train):
        assert prompt.prompt_ids.tolist() == (
            [BOS] + [digit(int(w)) for w in row.prompt.split()[1:-1]] + [EQUALS])
        assert prompt.label == row.label and prompt.answer_id == -1
    # refill: the dataset of seed + 7919, its own stream
    assert [p.label for p in made.replacement] == [r.label for r in sort_rows(1 + 7919, 12, 4, 50)]


def test_registry_and_flags_select_it():
    assert task_class_path("sort") == TASKS["sort"] == "replayrl.rollout.tasks.sort:SortTask"
    task = make_task(RolloutConfig(task="sort", max_response_len=17))
    assert type(task) is SortTask and task.environment() is None
    # --rollout-max-response-len left out: the answer's N + 1 tokens; given: kept
    assert build_config({"task": "sort", "answer-tokens": 8}).rollout.max_response_len == 9
    assert build_config({"task": "sort"}).rollout.max_response_len == 17
    assert build_config({"task": "sort", "rollout-max-response-len": 20}).rollout.max_response_len == 20
    assert build_config({}).rollout.max_response_len == 2  # the digit task as before
    # GRPO's std division: on by default for sort only, and a given flag wins
    assert build_config({"task": "sort"}).trainer.normalize_advantage_std is True
    assert build_config({"task": "sort", "grpo-std-normalization": False}
                        ).trainer.normalize_advantage_std is False
    assert build_config({}).trainer.normalize_advantage_std is False
    assert build_config({"task": "digits"}).trainer == build_config({}).trainer
    # context: <bos>, N digits, =, then the N + 1 answer tokens and 2 slots: 2 N + 5
    assert build_config({"task": "sort", "answer-tokens": 100}).max_context_tokens == 205


@pytest.mark.parametrize("settings, message", [
    ({"answer-tokens": 0}, "--answer-tokens must be >= 1"),
    ({"answer-tokens": 16, "rollout-max-response-len": 16},
     "--task sort: --rollout-max-response-len 16 cannot hold the answer of --answer-tokens 16: "
     "17 tokens"),
    ({"prompt-data": "a.jsonl"}, "--task sort: .*--prompt-data a.jsonl"),
    ({"rollout-max-turns": 2}, "--rollout-max-turns 2 .* --task sort has none"),
])
def test_bad_settings_are_refused_naming_the_flag(settings, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"task": "sort", **settings})


def test_a_context_longer_than_the_checkpoint_names_answer_tokens(tmp_path):
    # an --hf-checkpoint of the default model has 256 positions (the embedded model is built
    # with the positions of the run's context, --model-size)
    checkpoint = write_initial_checkpoint(build_config({}), tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"--answer-tokens \+ 2 \+ --rollout-max-turns x "
                                          r"\(--rollout-max-response-len \+ 2\) = 257 tokens exceeds the "
                                          r"model's 256 positions"):
        build_config({"task": "sort", "answer-tokens": 126, "hf-checkpoint": str(checkpoint)})
    assert build_config({"task": "sort", "answer-tokens": 126}).policy_config.max_position_embeddings == 257


@pytest.fixture
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the engine and the trainer backend set the process's threads


async def test_one_training_step_through_the_sort_task(tmp_path, _restore_threads):
    groups, n, answer = 2, 4, 8
    config = build_config({"task": "sort", "answer-tokens": answer, "rollout-batch-size": groups,
                           "n-samples-per-prompt": n, "progress": False,
                           "output-dir": str(tmp_path)})
    rig = await step_rig(config, tmp_path, "sort")
    step = await rig.one_step()
    summary, metrics, samples, before, after = step.summary, step.metrics, step.samples, step.before, step.after
    assert len(samples) == groups * n
    for s in samples:
        assert len(s.prompt_ids) == answer + 2 and 1 <= len(s.response_ids) <= answer + 1
    rewards = [by_hand(s.prompt_ids, s.response_ids) for s in samples]
    assert [s.reward for s in samples] == pytest.approx(rewards)
    assert summary["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert metrics["loss_tokens"] == sum(len(s.response_ids) for s in samples)
    assert rig.trainer.version == 1
    if any(len(set(rewards[g * n:(g + 1) * n])) > 1 for g in range(groups)):
        assert any(not np.array_equal(before[k], after[k]) for k in before)
