"""What the megatron backend (:mod:`replayrl.trainer.backends.megatron_backend`) refuses of a
run's settings, checked before any process starts: the arithmetic megatron-core would fail on
after every process started."""
from __future__ import annotations

from typing import Any

from replayrl.trainer.errors import TrainerConfigError


def check_run(run: Any) -> None:
    """Refuse a CUDA device (the backend trains on the CPU: its CUDA placement is not written,
    docs/gpu.md) and a parallel layout the policy does not split over (:func:`layout_errors`).

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read: ``device``,
            ``policy_config`` and the ``trainer``'s ``tp_size`` / ``ep_size`` / ``pp_size`` /
            ``cp_size``.
    Raises:
        TrainerConfigError: ``--device cuda``, or ``--device auto`` where torch sees a CUDA
            device; the first size that does not divide its model dimension (names the field
            and the flag).
    """
    # megatron_model imports torch: only a megatron run pays for it here
    import torch

    from replayrl.trainer.backends.megatron_model import MegatronParallel, layout_errors

    if run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available()):
        shown = "--device cuda" if run.device == "cuda" else "--device auto on a machine with CUDA"
        raise TrainerConfigError(f"--train-backend megatron with {shown}: the megatron backend "
                                 f"trains on the CPU (its CUDA placement is not written, "
                                 f"docs/gpu.md); use --device cpu, or --train-backend torch or "
                                 f"fsdp on the GPU")

    t = run.trainer
    layout = MegatronParallel(tp=t.tp_size, ep=t.ep_size, pp=t.pp_size, cp=t.cp_size)
    for problem in layout_errors(run.policy_config, layout):
        raise TrainerConfigError(f"{problem} (the policy's config.json)")
