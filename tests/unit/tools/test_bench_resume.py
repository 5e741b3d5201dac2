"""``replayrl bench resume``'s comparison of a resumed run's rows with an uninterrupted run's:
timings ignored, the first differing step and key named, prompts counted twice / skipped."""
from __future__ import annotations

from replayrl.tools.bench.resume import argv_of, compare


def _row(step: int, prompts: list[int], **keys) -> dict:
    return {"step": step, "prompt_indices": prompts, "reward_mean": 0.5, "step_seconds": 1.0 + step,
            "effective_tokens_per_second": 10.0, **keys}


def test_rows_equal_but_for_timings_are_equal():
    reference = [_row(0, [3, 1]), _row(1, [0, 2])]
    resumed = [_row(0, [3, 1], step_seconds=9.0), _row(1, [0, 2], effective_tokens_per_second=1.0)]
    assert compare(reference, resumed) == {"equal": True, "steps": [0, 1], "first_difference": None,
                                           "prompts_twice": 0, "prompts_skipped": 0}


def test_the_first_differing_step_and_key_are_named_and_prompts_counted():
    reference = [_row(0, [3, 1]), _row(1, [0, 2]), _row(2, [1, 3], grad_norm=0.25)]
    # step 1 trained prompt 3 again instead of 0; step 2 differs in two keys (first by name)
    resumed = [_row(0, [3, 1]), _row(1, [3, 2]), _row(2, [1, 3], grad_norm=0.5, clipfrac=0.1)]
    out = compare(reference, resumed)
    assert out["equal"] is False
    assert out["first_difference"] == {"step": 1, "key": "prompt_indices",
                                       "uninterrupted": [0, 2], "resumed": [3, 2]}
    assert (out["prompts_twice"], out["prompts_skipped"]) == (1, 1)  # 3 once more, 0 never
    assert compare(reference[2:], resumed[2:])["first_difference"]["key"] == "clipfrac"


def test_a_missing_row_is_a_difference_at_that_step():
    reference = [_row(0, [3, 1]), _row(1, [0, 2])]
    out = compare(reference, reference[:1])
    assert out["first_difference"] == {"step": 1, "key": "step", "uninterrupted": 2, "resumed": 1}
    assert (out["prompts_twice"], out["prompts_skipped"]) == (0, 2)


def test_flags_become_train_arguments():
    assert argv_of({"num-steps": 3, "rs-batch-refill": True, "metrics-hook": ["a:b", "c:d"]}) == [
        "--num-steps", "3", "--rs-batch-refill", "--metrics-hook", "a:b", "--metrics-hook", "c:d"]
