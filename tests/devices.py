"""The devices a device-dependent test runs on: the CPU always, and a CUDA device marked ``gpu``
(``pytest -m gpu``), which tests/conftest.py skips where torch sees none, with the reason
(a CPU-only torch build, or no device visible). Parametrise with
``@pytest.mark.parametrize("device", DEVICES)``: the test gets ``"cpu"`` or ``"cuda"``."""
from __future__ import annotations

import pytest

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
"""``--device`` values of the devices a test may run on, as pytest parameters."""
