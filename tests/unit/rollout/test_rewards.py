"""Built-in rewards, the reward time limit and evaluation figures (docs/design/prompt-data.md#prompt-data)."""
from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from replayrl.rollout.errors import RewardFailure
from replayrl.rollout.scoring.evaluation import eval_metrics, pass_at_k
from replayrl.rollout.scoring.rewards import RewardGuard, exact_reward, math_reward, normalise


def test_exact_reward_compares_normalised_text():
    assert normalise("  Paris\n\tFRANCE ") == "paris france"
    assert exact_reward(" Paris  France", "paris france") == 1.0
    assert exact_reward("Paris.", "paris") == 0.0
    assert exact_reward("ﬁne", "fine") == 1.0  # NFKC folds the ligature


def test_math_reward_checks_the_boxed_answer_with_math_verify():
    pytest.importorskip("math_verify")
    assert math_reward(r"so it is \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert math_reward(r"\boxed{3}", "4") == 0.0
    assert math_reward("no answer here", "4") == 0.0
    # on a worker thread, as the guard runs it (math-verify's own timeouts need the main one)
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(r"\boxed{2}", "2")))
    t.start()
    t.join()
    assert out == [1.0]


def _slow(x):
    time.sleep(3)
    return x


def _raise(x):
    raise KeyError("no such field")


async def test_a_reward_that_hangs_or_raises_names_the_sample_or_scores_zero():
    guard = RewardGuard(0.2, "error")
    assert await guard.score("sample 1", lambda x: x, 0.5) == 0.5
    start = time.monotonic()
    with pytest.raises(RewardFailure, match="sample 7: reward exceeded --reward-timeout-seconds 0.2"):
        await guard.score("sample 7", _slow, 1.0)
    assert time.monotonic() - start < 2.5  # did not wait for the call
    assert await guard.score("sample 8", lambda x: x, 0.25) == 0.25  # a fresh worker serves
    with pytest.raises(RewardFailure, match="sample 9: reward raised KeyError"):
        await guard.score("sample 9", _raise, 1.0)
    with pytest.raises(RewardFailure, match="not finite"):
        await guard.score("sample 10", lambda x: x, float("nan"))
    zero = RewardGuard(0.2, "zero")
    assert await zero.score("s", _slow, 1.0) == 0.0
    assert await zero.score("s", _raise, 1.0) == 0.0
    assert zero.failures == 2


def test_inline_rewards_fail_like_threaded_ones():
    guard = RewardGuard(0.2, "error")
    assert guard.score_inline("sample 1", lambda x: x, 0.5) == 0.5
    with pytest.raises(RewardFailure, match="sample 9: reward raised KeyError"):
        guard.score_inline("sample 9", _raise, 1.0)
    with pytest.raises(RewardFailure, match="sample 10: reward raised ValueError: reward is not finite"):
        guard.score_inline("sample 10", lambda x: x, float("inf"))
    zero = RewardGuard(0.2, "zero")
    assert zero.score_inline("s", _raise, 1.0) == 0.0 and zero.failures == 1


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (4, 4, 2), (6, 1, 6)])
def test_pass_at_k_is_the_chance_a_k_subset_holds_a_pass(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    naive = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(naive)


def test_eval_metrics_by_hand():
    rewards = np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
    assert eval_metrics("toy", rewards) == {
        "eval/toy/reward_mean": pytest.approx(1.5 / 6),
        "eval/toy/pass@1": pytest.approx((1 / 3 + 0) / 2),
        "eval/toy/pass@3": pytest.approx(0.5)}
