"""The wheel is one namespace: built from this checkout and installed into a clean venv, it
holds only ``replayrl/`` (and its dist-info), ``import tools`` fails there, and the console
script, ``python -m`` and the spawned actor processes run from it (issue: installed as
``replayrl``)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # built from a copy: setuptools reuses an in-tree build/ folder, whose stale modules (a file
    # since moved) would end up in the wheel
    source = tmp_path_factory.mktemp("source") / "replayrl"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", ".venv*", "runs", "__pycache__", ".pytest_cache"))
    # no build isolation: setuptools is already here and nothing may be downloaded
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(source)], check=True)
    (path,) = out.glob("replayrl-*.whl")
    return path


@pytest.fixture(scope="module")
def clean_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv without this checkout: the wheel installed with --no-deps, the dependencies
    (torch, pyzmq, ...) seen through a .pth line naming this interpreter's site-packages. A
    path a .pth adds is not scanned for .pth files itself, so the editable install of the
    checkout (a .pth finder there) stays out."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(root)
    python = root / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "replayrl_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True)
    return root


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_wheel_holds_only_the_replayrl_namespace(wheel: Path):
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"replayrl", "replayrl-0.1.0.dist-info"}
    names = set(zipfile.ZipFile(wheel).namelist())
    for layer in ("transport", "actors", "rollout", "trainer", "tools"):
        assert f"replayrl/{layer}/__init__.py" in names
    assert "replayrl/rollout/data/digits.jsonl" in names  # the built-in task's prompts


def test_the_installed_wheel_runs_without_the_checkout(clean_venv: Path, tmp_path: Path):
    python = clean_venv / "bin" / "python"
    env = _clean_env()
    bare = subprocess.run([str(python), "-c", "import tools"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert bare.returncode != 0 and "No module named 'tools'" in bare.stderr
    where = subprocess.run([str(python), "-c", "import replayrl.tools.cli as c; print(c.__file__)"],
                           cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    assert str(clean_venv) in where.stdout and str(REPO) not in where.stdout
    helped = subprocess.run([str(python), "-m", "replayrl.tools.cli", "--help"], cwd=tmp_path,
                            env=env, capture_output=True, text=True)
    assert helped.returncode == 0 and "train" in helped.stdout
    entry = subprocess.run([str(python), "-m", "replayrl.tools.run.torchrun_entry", "--help"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert entry.returncode == 0, entry.stderr
    # the console script; its actors are spawned processes that import replayrl by name
    run = subprocess.run([str(clean_venv / "bin" / "replayrl"), "train", "--num-steps", "2",
                          "--no-progress", "--output-dir", str(tmp_path / "out")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "replayrl: 2 steps" in run.stdout
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 2
