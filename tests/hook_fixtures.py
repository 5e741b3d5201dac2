"""A metrics hook for tests: records what it saw and what it could not change."""
from __future__ import annotations

import dataclasses

SEEN: list = []


def record(config, metrics) -> None:
    outcome = {"step": metrics["step"], "reward": metrics["reward_mean"]}
    try:
        metrics["reward_mean"] = 99.0
    except TypeError:
        outcome["metrics_read_only"] = True
    try:
        metrics["refill_round_detail" if "refill_round_detail" in metrics else "prompt_indices"].append(1)
    except AttributeError:
        outcome["nested_read_only"] = True
    try:
        config.rollout.top_k = 1
    except dataclasses.FrozenInstanceError:
        outcome["config_frozen"] = True
    SEEN.append(outcome)


REWARD_CALLS: list = []


def quarter_reward(prompt_ids, response_ids, loss_mask, answer_id, config) -> float:
    """A custom verifier that checks it cannot change what it was given."""
    try:
        response_ids[0] = 0
        writable = True
    except ValueError:
        writable = False
    try:
        config.top_k = 1
        frozen = False
    except dataclasses.FrozenInstanceError:
        frozen = True
    if writable or not frozen:
        raise AssertionError("custom reward received mutable inputs")
    return 0.25


def slow_reward(prompt_ids, response_ids, loss_mask, answer_id, config) -> float:
    """A custom verifier that never answers in time (for --reward-timeout-seconds)."""
    import time

    time.sleep(60)  # far over the test's 0.5 s limit; its daemon thread does not hold the exit
    return 1.0


HOLD_ENV = "REPLAYRL_TEST_HOLD_FILE"


def hold_after_steps_0_and_1(config, metrics) -> None:
    """Hold the driver after step 0 until the file named by ``$REPLAYRL_TEST_HOLD_FILE`` exists,
    and after step 1 until that name + ``.second`` exists (each at most 120 s): a test then
    knows the run is still live while it attaches, and again after step 1 (a tiny run's last
    steps take well under a second once let go)."""
    if metrics["step"] == 0:
        _wait_for_release()
    elif metrics["step"] == 1:
        _wait_for_release(".second")


def held_reward(prompt_ids, response_ids, loss_mask, answer_id, config) -> float:
    """A ``--custom-reward`` that holds its first call until ``$REPLAYRL_TEST_HOLD_FILE`` exists
    (at most 120 s; give ``--reward-timeout-seconds`` more). Custom rewards run in a thread, so
    the rollout manager, and the clock on its torchrun rank, keep answering while it waits;
    then 1.0 when the response starts with the answer digit."""
    _wait_for_release()
    return float(len(response_ids) > 0 and int(response_ids[0]) == answer_id)


def _wait_for_release(suffix: str = "") -> None:
    """Block until ``$REPLAYRL_TEST_HOLD_FILE`` + ``suffix`` exists (at most 120 s, then
    TimeoutError), after creating that name + ``.waiting``: a test that must act while the run
    is held (not before it gets there) waits for that file."""
    import os
    import time
    from pathlib import Path

    release = Path(os.environ[HOLD_ENV] + suffix)
    Path(os.environ[HOLD_ENV] + suffix + ".waiting").touch()
    deadline = time.monotonic() + 120.0
    while not release.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{release} was not created within 120 s")
        time.sleep(0.05)
