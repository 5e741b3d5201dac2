"""The ``--rs-mode`` / ``--rs-lower`` / ``--rs-upper`` check, without torch: the run settings
are checked in the launcher, which loads no torch (a torch runtime is ~200 MiB RSS:
VmRSS after ``import torch``, torch 2.13 CPU); the gate itself is
:class:`replayrl.trainer.rejection.rs_policy.RSGate`."""
from __future__ import annotations

import math

from replayrl.trainer.errors import TrainerConfigError

MODES = ("none", "token", "sequence", "geometric")


def check_rs_settings(mode: str, lower: float, upper: float) -> None:
    """Raise unless ``mode`` is one of :data:`MODES` and, when it is not ``none``, the ratio
    bounds satisfy ``0 < lower <= upper`` with ``lower`` finite.

    Raises:
        TrainerConfigError: naming the flag(s) and the values.
    """
    if mode not in MODES:
        raise TrainerConfigError(f"--rs-mode must be one of {MODES}, got {mode!r}")
    if mode != "none" and not (0 < lower <= upper and math.isfinite(lower)):
        raise TrainerConfigError(f"--rs-lower / --rs-upper must satisfy 0 < lower <= upper with a "
                                 f"finite lower bound, got {lower} / {upper}")
