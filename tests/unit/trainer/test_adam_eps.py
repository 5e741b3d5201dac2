"""``--adam-eps`` reaches the optimizer and floors AdamW's denominator: after a run of near-zero
gradients the first step is ``lr x g / (|g| + eps)`` per weight, far below ``lr`` where ``|g|`` is
below eps (docs/design/trainer-math.md#entropy-collapse)."""
from __future__ import annotations

import pytest
import torch

from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint
from replayrl.trainer.backends.torch_backend import TorchBackend
from replayrl.trainer.config import TrainerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_initial_checkpoint(build_config({}), tmp_path_factory.mktemp("init") / "model")


def test_the_default_eps_and_the_flag():
    assert TrainerConfig().adam_eps == 1e-6
    assert build_config({"adam-eps": 1e-5}).trainer.adam_eps == 1e-5


@pytest.mark.parametrize("eps", [1e-6, 1e-8])
def test_the_first_step_of_a_tiny_gradient_is_lr_g_over_g_plus_eps(model_dir, eps):
    backend = TorchBackend(str(model_dir), TrainerConfig(lr=1e-2, adam_eps=eps, clip_grad=1e9),
                           list(VOCABULARY))
    assert all(group["eps"] == eps for group in backend.optimizer.param_groups)
    p = next(backend.model.parameters())
    before = p.detach().clone()
    backend.zero_grad()
    for q in backend.model.parameters():
        q.grad = torch.zeros_like(q)
    p.grad.fill_(1e-7)  # |g| = 1e-7: m_hat = g, v_hat = g^2 after one step (bias-corrected)
    backend.clip_and_step(1e9)
    # by hand: 1e-2 x 1e-7 / (1e-7 + 1e-6) = 9.09e-4; with eps 1e-8: 1e-2 x 1e-7 / 1.1e-7 = 9.09e-3
    want = {1e-6: 1e-2 / 11, 1e-8: 1e-2 / 1.1}[eps]
    moved = (before - p.detach()).double()
    torch.testing.assert_close(moved, torch.full_like(moved, want), rtol=1e-4, atol=1e-9)
