"""The baseline of the entropy bonus: the step's mean surprisal, subtracted from every token's
entropy reward.

The bonus (``--entropy-coef beta``, :func:`replayrl.trainer.loss.losses.policy_loss`) gives each
token the reward ``-beta log pi(a_t)``, whose score-function gradient estimates ``beta grad H``
(Williams & Peng 1991). Every such reward is positive (about ``beta log K`` for a near-uniform
policy over a top-``K`` support), so without a baseline it pushes every sampled token up by
about the same amount: zero in expectation, but noise of the size of the early GRPO advantages
(docs/design/trainer-math.md#entropy-baseline has the measurement). A baseline independent of
the token keeps the estimate unbiased and removes that common offset (Williams 1992,
"Simple statistical gradient-following algorithms for connectionist reinforcement learning",
the REINFORCE baseline). The one here is a constant per optimizer step, computed once by the
leader from the behaviour logprobs the engine recorded, so it is the same on every
data-parallel rank and microbatch and needs no forward: with ``--entropy-baseline`` the
trainer subtracts ``beta * S`` from every sample's advantage, which turns the token's reward
into ``-beta (log pi(a_t) + S)``. ``S`` includes each token's own surprisal, a ``1/N`` share: the
estimate is unbiased up to that. It is opt-in: it learns faster early but left a 50m run on
the EOS plateau for 400 steps (the measurements are on that design page).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["mean_surprisal"]


def mean_surprisal(rollout_logprobs: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> float:
    """``S``, the mean of ``-logp_rollout`` over the tokens the step trains on that the engine
    sampled (nats).

    Args:
        rollout_logprobs: one float array [R_i] per sample, the behaviour logprobs (nats); rows
            outside the mask are not read (a synthetic EOS's placeholder may be anything).
        masks: one bool array [R_i] per sample: True where the token is a sampled loss token
            that the step trains on (the RS gate's and the group baseline's mask, and
            ``sampled_mask``).

    Returns:
        ``S`` as a Python float; 0.0 when no token is selected.

    Raises:
        ValueError: the two sequences differ in length, or a sample's arrays in shape.
    """
    if len(rollout_logprobs) != len(masks):
        raise ValueError(f"{len(rollout_logprobs)} logprob arrays against {len(masks)} masks")
    total, count = 0.0, 0
    for i, (lp, m) in enumerate(zip(rollout_logprobs, masks)):
        lp, m = np.asarray(lp), np.asarray(m, dtype=bool)
        if lp.shape != m.shape:
            raise ValueError(f"sample {i}: rollout_logprobs of shape {lp.shape} against a mask of {m.shape}")
        total -= float(lp[m].sum(dtype=np.float64))
        count += int(m.sum())
    return total / count if count else 0.0
