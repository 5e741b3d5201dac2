"""The package rules of docs/design.md §1 "Layout", read from the source with ``ast``.

- imports point downwards only: ``tools -> {rollout, trainer} -> actors -> transport``, and
  ``trainer`` reaches into ``rollout`` only for ``rollout.sample`` and ``rollout.model``;
- no import circle between production modules (``TYPE_CHECKING`` imports included: a circle
  that only type checkers see is still two modules that know each other);
- every production module has a production caller, except the entry points and the
  context-parallel piece, kept for a megatron-core backend with CP (docs/design.md §12
  "Parallel pieces"); the megatron backend calls the vocabulary-parallel and replay-registry
  pieces.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("transport", "actors", "rollout", "trainer", "tools")
ALLOWED = {  # package -> packages it may import
    "transport": {"transport"},
    "actors": {"actors", "transport"},
    "rollout": {"rollout", "actors", "transport"},
    "trainer": {"trainer", "actors", "transport", "rollout"},
    "tools": set(PACKAGES),
}
TRAINER_MAY_USE = ("rollout.sample", "rollout.model")
ENTRY_POINTS = {"tools.cli", "tools.torchrun_entry"}  # console script / `torchrun -m`


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path], *, strings: bool) -> set[str]:
    """Production modules ``path`` imports (any depth, lazy imports included); with ``strings``
    also those it names as ``"module:Class"`` or ``"package.module"`` strings (how actor specs,
    registries and the bench command refer to code they import on demand)."""
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in modules:  # `from a.b import c` where c is a function
            name = name.rpartition(".")[0]
        if name:
            found.add(name)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                add(f"{node.module}.{alias.name}")
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            candidate = node.value.partition(":")[0]
            if candidate in modules:
                found.add(candidate)
    return found


MODULES = _modules()
GRAPH = {name: _imports(path, MODULES, strings=False) - {name} for name, path in MODULES.items()}
USES = {name: _imports(path, MODULES, strings=True) - {name} for name, path in MODULES.items()}
PACKAGE_INITS = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def test_the_scan_sees_the_known_edges():
    # the checker itself: a known direct import, a lazy import and a "module:Class" string
    assert "rollout.sample" in GRAPH["trainer.trainer_actor"]
    assert "rollout.engines.embedded" in USES["rollout.engines"]  # registry string
    assert "rollout.engines.embedded" not in GRAPH["rollout.engines"]  # not imported at load
    assert "tools.launcher" in GRAPH["tools.repl"]  # imported inside a method
    assert len(MODULES) > 50


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_downwards(module):
    package = module.split(".")[0]
    bad = sorted(m for m in GRAPH[module] if m.split(".")[0] not in ALLOWED[package])
    if package == "trainer":
        bad += sorted(m for m in GRAPH[module] if m.split(".")[0] == "rollout"
                      and not m.startswith(TRAINER_MAY_USE))
    assert not bad, f"{module} imports {bad} against docs/design.md §1"


def test_no_import_circle():
    # Tarjan-free check: a module reaching itself through the graph is in a circle
    circles = []
    for start in GRAPH:
        seen, stack = set(), list(GRAPH[start])
        while stack:
            m = stack.pop()
            if m == start:
                circles.append(start)
                break
            if m not in seen:
                seen.add(m)
                stack.extend(GRAPH[m])
    # a package's __init__ re-exporting its own modules is not a circle between two modules
    circles = [m for m in circles if not _only_through_own_init(m)]
    assert not circles, f"modules in an import circle: {circles}"


def _only_through_own_init(start: str) -> bool:
    """True if every way back to ``start`` passes through a package ``__init__`` that is an
    ancestor of ``start`` (re-exports such as ``actors/__init__.py`` importing ``actors.ref``)."""
    ancestors = {start.rsplit(".", i)[0] for i in range(1, start.count(".") + 1)}
    seen, stack = set(), [m for m in GRAPH[start] if m not in ancestors]
    while stack:
        m = stack.pop()
        if m == start:
            return False
        if m not in seen and m not in ancestors:
            seen.add(m)
            stack.extend(GRAPH[m])
    return True


def test_every_production_module_has_a_production_caller():
    callers = {m: {c for c, deps in USES.items() if m in deps} for m in MODULES}
    orphans = sorted(m for m, c in callers.items()
                     if not c and m not in ENTRY_POINTS and m not in PACKAGE_INITS)
    assert not orphans, f"production modules only tests call: {orphans}"
