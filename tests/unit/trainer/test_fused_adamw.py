"""``FusedAdamW`` is ``torch.optim.AdamW(fused=True)`` without the base class's ``torch._dynamo``
import: the same updates bit for bit, state dicts that load into each other, clear refusals
(that a backend step leaves ``torch._dynamo`` unimported: tests/system/test_trainer_without_dynamo.py)."""
from __future__ import annotations

import copy

import pytest
import torch

from replayrl.trainer.backends.optimizer import FusedAdamW

SETTINGS = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 4, generator=g)),
            torch.nn.Parameter(torch.randn(5, generator=g)),
            torch.nn.Parameter(torch.randn(3, 2, generator=g))]


def _steps(optimizer, params, n: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for i, p in enumerate(params):
            # the third parameter gets no gradient on even steps: it must be skipped, as torch does
            p.grad = None if i == 2 and optimizer_step_is_even(optimizer) else torch.randn(p.shape, generator=g)
        optimizer.step()


def optimizer_step_is_even(optimizer) -> bool:
    """Whether the first parameter's step count (torch's state) is even before this step."""
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0])
    return state is None or int(state["step"]) % 2 == 0


def test_updates_equal_torch_adamw_fused_bit_for_bit():
    mine_params, ref_params = _params(), _params()
    mine = FusedAdamW(mine_params, **SETTINGS)
    ref = torch.optim.AdamW(ref_params, fused=True, **SETTINGS)
    _steps(mine, mine_params, 7)
    _steps(ref, ref_params, 7)
    for a, b in zip(mine_params, ref_params):
        assert torch.equal(a, b)
    for a, b in zip(mine_params, ref_params):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(mine.state[a][key], ref.state[b][key]), key


def test_state_dicts_load_into_each_other_and_training_continues_identically():
    ref_params, mine_params, back_params = _params(), _params(), _params()
    ref = torch.optim.AdamW(ref_params, fused=True, **SETTINGS)
    _steps(ref, ref_params, 3)
    with torch.no_grad():
        for m, b, r in zip(mine_params, back_params, ref_params):
            m.copy_(r)
            b.copy_(r)
    mine = FusedAdamW(mine_params, lr=1.0)  # the saved group's settings replace these
    mine.load_state_dict(ref.state_dict())
    assert mine.param_groups[0]["lr"] == SETTINGS["lr"]
    back = torch.optim.AdamW(back_params, fused=True)
    # deep copies as a checkpoint file gives: torch's loader keeps the tensors it is handed
    back.load_state_dict(copy.deepcopy(mine.state_dict()))  # torch's loader validates our layout
    for opt, params in ((ref, ref_params), (mine, mine_params), (back, back_params)):
        _steps(opt, params, 4, seed=9)
    for a, b, c in zip(ref_params, mine_params, back_params):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_state_dict_that_does_not_fit_is_refused_before_anything_changes():
    params = _params()
    donor = FusedAdamW(_params(), **SETTINGS)
    _steps(donor, donor.param_groups[0]["params"], 2)
    state = donor.state_dict()
    mine = FusedAdamW(params, **SETTINGS)
    fewer = FusedAdamW(params[:2], **SETTINGS)
    with pytest.raises(ValueError, match="one group of 2"):
        fewer.load_state_dict(state)
    state["state"][1]["exp_avg"] = torch.zeros(4)
    with pytest.raises(ValueError, match="entry 1 exp_avg: shape"):
        mine.load_state_dict(state)
    assert mine.state == {}


def test_zero_grad():
    params = _params()
    opt = FusedAdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
