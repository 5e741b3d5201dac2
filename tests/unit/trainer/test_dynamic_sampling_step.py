"""One --dynamic-sampling optimizer step, in-process: a real EngineActor, RolloutManager and
TrainerActor joined by fake proxies (tests/fakes.py), built by tests/step_rig.py as for
tests/unit/rollout/test_task_room.py's step.

The task is tests/fake_task.py's with one change: the first prompt's reward is always 1, so
its groups never carry a learning signal. Which groups must drop, how many replacement
rounds were needed and which groups the step trains on are worked out here from the sampled
tokens by hand (the fake task's rule), never read off the trainer.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from replayrl.actors.errors import StaleSample
from replayrl.actors.version_clock import VersionRules
from replayrl.rollout.sample import samples_from_columns
from replayrl.rollout.tasks import TASKS, RewardCall
from replayrl.tools.run.from_flags import build_config
from tests.fake_task import FakeTask, first_token_even
from tests.step_rig import step_rig


def _always_one(response_ids: np.ndarray) -> float:
    return 1.0


class FirstPromptSolved(FakeTask):
    """:class:`tests.fake_task.FakeTask`, but prompt 0 always scores 1.0 (zero variance)."""

    def reward(self, tokenizer, prompt, response_ids, loss_mask) -> RewardCall:
        """1.0 for prompt 0, else the fake task's even-first-token reward."""
        if prompt.index == 0:
            return RewardCall(_always_one, (response_ids,), bounded=True)
        return super().reward(tokenizer, prompt, response_ids, loss_mask)


def _by_hand(sample) -> float:
    return 1.0 if tuple(sample.prompt_ids.tolist()) == (1, 13, 3, 4, 5, 17) else \
        first_token_even(sample.response_ids)


@pytest.fixture
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the engine and the trainer backend set the process's threads


async def test_step_trains_on_exactly_the_configured_informative_groups(monkeypatch, tmp_path,
                                                                         _restore_threads):
    monkeypatch.setitem(TASKS, "first_prompt_solved",
                        "tests.unit.trainer.test_dynamic_sampling_step:FirstPromptSolved")
    groups, n = 3, 2
    config = build_config({"task": "first_prompt_solved", "rollout-batch-size": groups,
                           "n-samples-per-prompt": n, "progress": False, "seed": 3,
                           "dynamic-sampling": True, "rs-refill-max-rounds": 20,
                           "output-dir": str(tmp_path)})
    rig = await step_rig(config, tmp_path, "first_prompt_solved")
    trainer, manager = rig.trainer, rig.manager
    await manager.generate(0, min_version=0)

    replacements, rules = [], VersionRules()

    async def generate_replacements(n_groups, min_version):
        assert min_version == trainer.version == 0
        replacements.append(await manager.generate_replacements(n_groups, min_version))
        return replacements[-1]

    async def check_replacements(preflight_version, ids, versions):
        bad = [s for s, v in zip(ids, versions) if not rules.replacement_ok(preflight_version, v)]
        if bad:
            raise StaleSample(f"not at the preflight version: {bad}")

    rig.connect(manager_methods={"generate_replacements": generate_replacements},
                clock_methods={"check_replacements": check_replacements})
    trained = []
    update = trainer._update

    async def spy_update(samples, token_accept, fused=False):
        trained.extend(samples)
        return await update(samples, token_accept, fused=fused)

    trainer._update = spy_update
    metrics = await trainer.train(0)

    # by hand: every candidate group (initial, then each replacement round in request order)
    # and whether its rewards differ; the first `groups` informative ones are trained on
    rounds = [samples_from_columns(rig.taken[0])] + [samples_from_columns(r) for r in replacements]
    candidates = []
    for batch in rounds:
        for s in batch:
            assert s.reward == _by_hand(s)  # the task's rule, applied here
        by_group: dict[int, list] = {}
        for s in batch:
            by_group.setdefault(s.group_id, []).append(s)
        candidates += [(g, len({s.reward for s in ss}) > 1) for g, ss in by_group.items()]
    informative = [g for g, ok in candidates if ok]
    zero_variance = sum(not ok for _, ok in candidates)
    # each epoch is a permutation of the 3 prompts: the 3 initial groups hold prompt 0 once
    assert zero_variance >= 1
    assert [g for g in dict.fromkeys(s.group_id for s in trained)] == informative[:groups]
    assert len(trained) == groups * n
    assert (metrics["trained_groups"], metrics["admitted_groups"]) == (groups, groups)
    assert metrics["zero_variance_groups"] == metrics["rejected_groups"] == zero_variance
    assert metrics["refill_rounds"] == len(replacements)
    assert metrics["surplus_groups"] == len(informative) - groups
    # no RS gate: no preflight, the update computed the proximal logprobs itself
    assert metrics["preflight_seconds"] == 0.0 and trainer.cache.entries == {}
    assert all(s.policy_version == 0 for s in trained) and trainer.version == 1
