"""Suite-wide settings: this checkout's code, one intra-op thread per test process, the
``system`` marker and its guard.

- The suite tests the checkout it lives in. ``replayrl`` is an implicit namespace package
  (pyproject.toml ``package-dir``); when the installed one is another checkout (a git worktree,
  a second clone), a folder of symlinks to this checkout goes first on ``sys.path`` and on
  ``PYTHONPATH`` (inherited by every process a test starts), as ``replayrl bench steps`` does.
- The suite runs on 2-core machines shared with other work; two OpenMP threads waiting on each
  other made single small forwards 40x slower than one thread (measured in the replay tests).
  Actor processes set their own thread counts.
- Tests under ``tests/system/`` start processes (actors, torchrun, a pseudo-terminal, a venv, a
  server) and are marked ``system``; ``pytest -m "not system"`` is the fast subset. A test
  outside that folder that starts a process fails, naming what it started.
"""
import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _use_this_checkout() -> None:
    spec = importlib.util.find_spec("replayrl.transport")
    if spec is not None and Path(spec.origin).resolve().parent == ROOT / "transport":
        return
    tree = importlib.util.spec_from_file_location(
        "_replayrl_source_tree", ROOT / "tools" / "bench" / "source_tree.py")
    module = importlib.util.module_from_spec(tree)
    tree.loader.exec_module(module)
    path = str(module.importable(ROOT, Path(tempfile.mkdtemp(prefix="replayrl-checkout-"))))
    atexit.register(shutil.rmtree, path, True)  # a folder of symlinks per session: not left behind
    sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [path] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    for name in [m for m in sys.modules if m == "replayrl" or m.startswith("replayrl.")]:
        del sys.modules[name]


_use_this_checkout()

import torch  # noqa: E402

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


@pytest.fixture
def ipc_tmp():
    """A short empty directory for a child process's ``TMPDIR`` (removed afterwards): the actors'
    ipc socket files go there, AF_UNIX caps their paths at 107 bytes, and ``tmp_path`` is nested
    deep enough (deeper still under pytest-xdist's per-worker folders) to pass the cap."""

    path = Path(tempfile.mkdtemp(prefix="rrl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_excepthook():
    """Put back ``sys.excepthook`` after each test: ``torch.distributed.init_process_group`` wraps
    it to prefix ``[rankN]:`` (and ``destroy_process_group`` leaves the wrapper), so a later test
    in the same pytest process (an xdist worker runs many) would see its tracebacks prefixed."""
    hook = sys.excepthook
    yield
    sys.excepthook = hook


SYSTEM = ROOT / "tests" / "system"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under ``tests/system/`` ``system`` (``-m "not system"``: the fast subset),
    and skip every ``gpu`` test where torch sees no CUDA device, saying why
    (:func:`replayrl.actors.device.cuda_absent_reason`)."""
    from replayrl.actors.device import cuda_absent_reason

    absent = cuda_absent_reason()
    for item in items:
        if SYSTEM in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.system)
        if absent and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA device: {absent}"))


@pytest.fixture(autouse=True, scope="session")
def _matplotlib_font_cache() -> None:
    """matplotlib builds its font cache on first use by running ``fc-list``: on a machine without
    the cache, whichever plotting unit test came first failed the process guard below. Build it
    once per test process, before any test's guard."""
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib.font_manager  # noqa: F401 -- importing it loads or builds the cache


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A test outside ``tests/system/`` that starts a process fails, naming it: the fast subset
    stays fast only if what starts processes lives in the system folder."""
    if request.node.get_closest_marker("system"):
        yield
        return
    import multiprocessing.util
    import pty
    import subprocess

    started: list[str] = []

    def guard(name: str, real):
        def wrapper(*args, **kwargs):
            started.append(f"{name}{tuple(a for a in args[:2] if isinstance(a, (str, list)))}")
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(subprocess.Popen, "_execute_child",
                        guard("subprocess", subprocess.Popen._execute_child))
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds",
                        guard("multiprocessing", multiprocessing.util.spawnv_passfds))
    monkeypatch.setattr(os, "fork", guard("os.fork", os.fork))
    monkeypatch.setattr(pty, "fork", guard("pty.fork", pty.fork))
    yield
    record = os.environ.get("REPLAYRL_RECORD_PROCESS_TESTS")
    if started and record:  # classification aid: list them instead of failing
        with open(record, "a") as out:
            out.write(f"{request.node.nodeid}\t{started[0]}\n")
    elif started:
        pytest.fail(f"{request.node.nodeid} started a process ({started[0]}); tests that start "
                    f"processes belong in tests/system/", pytrace=False)
