"""Suite-wide settings: one intra-op thread per test process.

The suite runs on 2-core machines shared with other work; two OpenMP threads waiting on each
other made single small forwards 40x slower than one thread (measured in tests/test_replay.py).
Actor processes set their own thread counts.
"""
import torch

torch.set_num_threads(1)


import pytest  # noqa: E402

from replayrl.transport.curve import CurveKeys, create_keys  # noqa: E402


@pytest.fixture(scope="session")
def curve_keys(tmp_path_factory: pytest.TempPathFactory) -> CurveKeys:
    """One CURVE key pair (``replayrl keys``' files) for every tcp test of the session."""
    return CurveKeys.load(create_keys(tmp_path_factory.mktemp("keys") / "keys").parent)


@pytest.fixture(scope="session")
def curve_keys_dir(curve_keys: CurveKeys, tmp_path_factory: pytest.TempPathFactory):
    """The directory holding :func:`curve_keys`' files (for ``--curve-keys``)."""
    return str(next(tmp_path_factory.getbasetemp().glob("keys*/keys")))
