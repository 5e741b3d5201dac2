"""The trainer backend's optimizer step leaves ``torch._dynamo`` unimported: the RSS that
``torch.optim.Optimizer``'s methods cost a process (~70 MiB VmRSS,
replayrl.trainer.backends.optimizer)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from replayrl.tools.run.from_flags import build_config
from replayrl.tools.run.launcher import write_initial_checkpoint


def test_a_torch_backend_step_never_imports_torch_dynamo(tmp_path):
    """The memory this exists for: a fresh process that builds the embedded trainer backend and
    takes an optimizer step has not imported the compiler stack."""
    model = write_initial_checkpoint(build_config({}), tmp_path / "model")
    script = textwrap.dedent(f"""
        import sys, torch
        from replayrl.rollout.tasks.digit_puzzle import VOCABULARY
        from replayrl.trainer.backends.torch_backend import TorchBackend
        from replayrl.trainer.config import TrainerConfig
        model = {str(model)!r}
        backend = TorchBackend(str(model), TrainerConfig(), list(VOCABULARY))
        before = [p.detach().clone() for p in backend.model.parameters()]
        for p in backend.model.parameters():
            p.grad = torch.ones_like(p)
        backend.clip_and_step(1.0)
        moved = sum(not torch.equal(b, p) for b, p in zip(before, backend.model.parameters()))
        print(moved, "torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    moved, imported = out.stdout.split()
    assert int(moved) > 0 and imported == "False"
