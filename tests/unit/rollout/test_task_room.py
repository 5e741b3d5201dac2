"""The task room (rollout/tasks/): the registry, the task the flags select, the refusal of a
multi-turn run whose task has no environment, and one training step of a task added the way
docs/architecture.md says (tests/fake_task.py plus one registry line).

The step runs in-process (tests/step_rig.py): a real EngineActor, RolloutManager and
TrainerActor, joined by fake proxies (tests/fakes.py) instead of processes. Its expected
rewards are the fake task's rule applied here, by hand, to the tokens the engine sampled."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.rollout.config import RolloutConfig
from replayrl.rollout.dispatch.manager import RolloutError, RolloutManager
from replayrl.rollout.tasks import (
    TASKS,
    TaskConfigError,
    UnknownTask,
    load_task_class,
    make_task,
    task_class_path,
    task_name,
)
from replayrl.rollout.tasks.calculator import DigitToolEnv
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.rollout.tasks.digits import DigitsTask
from replayrl.rollout.tasks.prompt_file import PromptFileTask
from replayrl.tools.run.config import ConfigError
from replayrl.tools.run.from_flags import build_config
from tests.fake_task import PROMPTS
from tests.step_rig import step_rig


@pytest.fixture
def fake_task(monkeypatch):
    """The one registry line that adds the fake task."""
    monkeypatch.setitem(TASKS, "fake", "tests.fake_task:FakeTask")
    return "fake"


def test_the_flags_select_the_task_as_before():
    assert task_name(RolloutConfig()) == "digits"
    assert task_name(RolloutConfig(prompt_data="a.jsonl")) == "prompt_file"
    assert task_name(RolloutConfig(task="digits")) == "digits"
    assert type(make_task(RolloutConfig())) is DigitsTask
    assert type(make_task(RolloutConfig(prompt_data="a.jsonl"))) is PromptFileTask
    assert isinstance(make_task(RolloutConfig()).environment(), DigitToolEnv)
    assert make_task(RolloutConfig(prompt_data="a.jsonl")).environment() is None


def test_registry_names_unknown_and_unfit_classes():
    assert task_class_path("digits") == "replayrl.rollout.tasks.digits:DigitsTask"
    with pytest.raises(UnknownTask, match=r"unknown task 'gsm'; known tasks: digits, prompt_file, sort"):
        task_class_path("gsm")
    with pytest.raises(TaskConfigError, match="not a replayrl.rollout.tasks.base.Task subclass"):
        load_task_class("replayrl.rollout.tasks.digit_puzzle:DigitTask")
    with pytest.raises(TaskConfigError, match="no_such_module"):
        load_task_class("no_such_module:Task")


@pytest.mark.parametrize("settings, message", [
    ({"task": "gsm"}, "--task gsm: unknown task 'gsm'"),
    ({"task": "prompt_file"}, "--task prompt_file: .*--prompt-data FILE"),
    ({"task": "digits", "prompt-data": "a.jsonl"}, "--task digits: .*--prompt-data a.jsonl"),
    ({"prompt-data": "a.jsonl", "rollout-max-turns": 2},
     r"--rollout-max-turns 2 needs the task's multi-turn environment, but --task prompt_file "
     r"\(chosen by --prompt-data\) has none"),
    ({"task": "prompt_file", "prompt-data": "a.jsonl", "rollout-max-turns": 3},
     "--rollout-max-turns 3 .* --task prompt_file has none"),
])
def test_unusable_task_settings_are_refused_before_start(settings, message):
    with pytest.raises(ConfigError, match=message):
        build_config({**settings, "progress": False})


def test_multi_turn_needs_an_environment(fake_task):
    with pytest.raises(ConfigError, match="--rollout-max-turns 2 .* --task fake has none"):
        build_config({"task": fake_task, "rollout-max-turns": 2})
    assert build_config({"rollout-max-turns": 2}).rollout.max_turns == 2  # digits: calculator
    # the manager refuses it too (a config that skipped the run configuration), before reading
    # its tokenizer
    with pytest.raises(RolloutError, match="--rollout-max-turns 2: the task FakeTask has no"):
        RolloutManager(RolloutConfig(task=fake_task, max_turns=2).to_dict(), ["engine_0"], [],
                       256, "/nonexistent", len(VOCABULARY))


@pytest.fixture
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the engine and the trainer backend set the process's threads


async def test_a_registered_task_trains_one_step(fake_task, tmp_path, _restore_threads):
    groups, n = 2, 4
    config = build_config({"task": fake_task, "rollout-batch-size": groups,
                           "n-samples-per-prompt": n, "progress": False,
                           "output-dir": str(tmp_path)})
    rig = await step_rig(config, tmp_path, fake_task)
    step = await rig.one_step()
    summary, metrics, samples, before, after = step.summary, step.metrics, step.samples, step.before, step.after
    assert len(samples) == groups * n
    # every prompt is one of the fake task's, each group of n shares one
    assert {tuple(s.prompt_ids.tolist()) for s in samples} <= set(PROMPTS)
    for g in range(groups):
        assert len({tuple(s.prompt_ids.tolist()) for s in samples[g * n:(g + 1) * n]}) == 1
    # the rewards are the fake task's rule, applied here by hand
    by_hand = [1.0 if int(s.response_ids[0]) % 2 == 0 else 0.0 for s in samples]
    assert [s.reward for s in samples] == by_hand
    assert summary["reward_mean"] == pytest.approx(sum(by_hand) / len(by_hand))
    assert summary["prompt_indices"] == [PROMPTS.index(tuple(samples[g * n].prompt_ids.tolist()))
                                         for g in range(groups)]
    # one optimizer step over every response token (single turn: loss mask all ones)
    assert metrics["loss_tokens"] == sum(len(s.response_ids) for s in samples)
    assert (metrics["skipped"], metrics["trained_groups"]) == (0, groups)
    assert rig.trainer.version == 1
    # a group with rewards that differ has a non-zero advantage, so the weights moved
    if any(len(set(by_hand[g * n:(g + 1) * n])) > 1 for g in range(groups)):
        assert any(not np.array_equal(before[k], after[k]) for k in before)
