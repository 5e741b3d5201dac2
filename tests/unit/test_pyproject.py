"""pyproject.toml lists every package under the ``replayrl`` namespace (setuptools' ``find``
cannot prefix a namespace, so the list is written out) and maps each layer's folder."""
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("transport", "actors", "rollout", "trainer", "tools")


def test_every_package_folder_is_listed_under_the_namespace():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {"replayrl." + ".".join(init.parent.relative_to(REPO).parts)
               for layer in LAYERS for init in (REPO / layer).rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk
    assert setuptools["package-dir"] == {f"replayrl.{layer}": layer for layer in LAYERS}


def test_the_console_script_is_the_namespaced_cli():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"replayrl": "replayrl.tools.cli:main"}
