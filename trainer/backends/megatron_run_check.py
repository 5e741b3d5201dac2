"""What the megatron backend (:mod:`replayrl.trainer.backends.megatron_backend`) refuses of a
run's settings, checked before any process starts: the arithmetic megatron-core would fail on
after every process started."""
from __future__ import annotations

from typing import Any

from replayrl.trainer.backends.megatron_families import MEGATRON_FAMILIES, NOT_YET
from replayrl.trainer.errors import TrainerConfigError


def check_family(family: str, checkpoint: str) -> None:
    """Refuse a family room policy the megatron backend does not build.

    Args:
        family: the policy's HF ``model_type`` (``""`` for the embedded model: accepted).
        checkpoint: ``--hf-checkpoint`` (named in the message).
    Raises:
        TrainerConfigError: a family outside :data:`MEGATRON_FAMILIES`, naming what of it is
            not supported yet.
    """
    if not family or family in MEGATRON_FAMILIES:
        return
    what = NOT_YET.get(family, "its architecture (not mapped onto megatron-core's modules)")
    raise TrainerConfigError(
        f"--train-backend megatron cannot train the {family!r} family of --hf-checkpoint "
        f"{checkpoint} yet: {what} is not supported; it trains {' and '.join(MEGATRON_FAMILIES)}, "
        f"or use --train-backend torch or fsdp for {family!r}")


def check_run(run: Any) -> None:
    """Refuse a CUDA device (the backend trains on the CPU: its CUDA placement is not written,
    docs/gpu.md), a family room policy it does not build (:func:`check_family`) and a parallel
    layout the policy does not split over (:func:`layout_errors`; for a family also the
    config.json fields the MLA mapping does not compute).

    Args:
        run: the run's settings (a ``replayrl.tools.run.config.RunConfig``); read: ``device``,
            ``policy_config`` and the ``trainer``'s ``tp_size`` / ``ep_size`` / ``pp_size`` /
            ``cp_size``.
    Raises:
        TrainerConfigError: ``--device cuda``, or ``--device auto`` where torch sees a CUDA
            device; a family outside :data:`MEGATRON_FAMILIES`; the first size that does not
            divide its model dimension (names the field
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

    from replayrl.rollout.model.families.run_check import family_of

    check_family(family_of(run.policy_config), run.hf_checkpoint)
    t = run.trainer
    layout = MegatronParallel(tp=t.tp_size, ep=t.ep_size, pp=t.pp_size, cp=t.cp_size)
    for problem in layout_errors(run.policy_config, layout):
        raise TrainerConfigError(f"--train-backend megatron: {problem} (the policy's config.json)")
