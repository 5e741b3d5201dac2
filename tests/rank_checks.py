"""Shared test helper: the checks that a step over several trainer ranks (tests/system/
test_trainer_ranks.py's torch DDP, test_fsdp_ranks.py's FSDP2) is the one-rank step."""
from __future__ import annotations

import numpy as np
import pytest


def assert_same_step_metrics(row: dict, reference_row: dict) -> None:
    """The same batch, split over the ranks: the metrics ``row`` has the one-rank
    ``reference_row``'s token and group counts exactly, its gradient norm within rel 1e-5 (the
    order of the float sums) and its logprob / TIS / support-entropy / surprisal means within rel
    1e-4."""
    for key in ("loss_tokens", "accepted_tokens", "sampled_tokens", "trained_groups"):
        assert row[key] == reference_row[key]
    assert row["grad_norm"] == pytest.approx(reference_row["grad_norm"], rel=1e-5)
    for key in ("train_rollout_logprob_abs_diff", "tis_weight_mean", "support_entropy_mean",
                "surprisal_mean"):
        assert row[key] == pytest.approx(reference_row[key], rel=1e-4, abs=1e-6)


def assert_same_update(one: dict[str, np.ndarray], two: dict[str, np.ndarray], start: dict[str, np.ndarray],
                       lr: float) -> None:
    """``two`` (the several-rank trainer's weights ``param/...`` and Adam moments ``opt/...``,
    flat float32 by name) is ``one`` (the one-rank trainer's after the same step), and the step
    moved the weights from ``start`` (by about ``lr``)."""
    assert set(one) == set(two)
    moved = max(float(np.abs(one[k] - start[k]).max()) for k in one if k.startswith("param/"))
    assert moved > 1e-4
    for k in one:
        assert one[k].shape == two[k].shape, k
        if k.startswith("opt/"):
            # Adam's moments hold the gradient (0.1 g) and its square: the several-rank gradient
            # is the one-rank one up to the order of the float sums (a wrong scale or a missing
            # share fails here and in grad_norm)
            scale = float(np.abs(one[k]).max())
            np.testing.assert_allclose(two[k], one[k], rtol=1e-4, atol=1e-4 * scale, err_msg=k)
        else:
            # the first Adam update is lr x g / (|g| + eps): where |g| is near eps (--adam-eps)
            # the rounding noise of g moves it by a fraction of lr, elsewhere it is lr x sign(g)
            np.testing.assert_allclose(two[k], one[k], rtol=0, atol=0.2 * lr, err_msg=k)
