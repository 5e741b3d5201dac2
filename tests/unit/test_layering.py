"""The package rules of docs/design/layout.md#layout, read from the source with ``ast``.

- imports point downwards only: ``tools -> {rollout, trainer} -> actors -> transport``, and
  ``trainer`` reaches into ``rollout`` only for ``replayrl.rollout.sample``, the trace table it
  reads (``replayrl.rollout.traces.trace_table``), ``replayrl.rollout.model`` and the weight-sync
  room (``replayrl.rollout.weight_sync``, which packs a push on the trainer and loads it on the
  engine);
- the trainer backends hand over tensors and never see a transport: no backend module imports
  ``replayrl.transport``, the shared-memory sends of ``replayrl.actors.ref`` or the weight-sync
  room (a way of moving weights is that room's, not a backend's);
- rollout/ and trainer/ keep each concept in a room (a subfolder whose ``__init__`` says what it
  holds); their roots keep only settings, errors and the sample contract, and the leaf rooms
  (traces, sampling, scoring, model; loss, replay, lora) stand on the root modules alone;
- no import circle between production modules (``TYPE_CHECKING`` imports included: a circle
  that only type checkers see is still two modules that know each other);
- every production module has a production caller, except the entry points and the
  context-parallel piece, kept for a megatron-core backend with CP (docs/design/megatron.md#parallel-pieces);
  the megatron backend calls the vocabulary-parallel and replay-registry
  pieces.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import REPO

ROOT = REPO
PACKAGES = ("transport", "actors", "rollout", "trainer", "tools")  # the layers' folders
ALLOWED = {  # layer -> layers it may import
    "transport": {"transport"},
    "actors": {"actors", "transport"},
    "rollout": {"rollout", "actors", "transport"},
    "trainer": {"trainer", "actors", "transport", "rollout"},
    "tools": set(PACKAGES),
}
# the trace table is part of the sample contract: the trainer batch and the flip / drift rates
# read each trace's row space, padding, batch field and replay switch from it
TRAINER_MAY_USE = ("replayrl.rollout.sample", "replayrl.rollout.traces.trace_table", "replayrl.rollout.model",
                   "replayrl.rollout.weight_sync")
# what a trainer backend may not import: the wire, the shared-memory sends, the weight syncs
TRANSPORT_DETAILS = ("replayrl.transport", "replayrl.actors.ref", "replayrl.rollout.weight_sync")
# the rooms of tools/: the run is the core the others stand on; the console and the benchmarks
# use the run, never each other; cli.py and serve.py sit beside the rooms
ROOMS_MAY_USE = {"run": {"run"}, "console": {"console", "run"}, "bench": {"bench", "run"},
                 "sft": {"sft", "run"}}
TOOLS_ERRORS = "replayrl.tools.errors"  # the layer's errors module: a leaf every room may use
# the rooms of rollout/ and trainer/: each concept in a subfolder; the layer's root keeps only
# its settings, its errors and (rollout) the sample contract, so a new module has to find a room
LAYER_ROOT_MODULES = {"rollout": {"config", "errors", "sample"}, "trainer": {"config", "errors"}}
# leaf rooms stand on the layer's root modules alone: the concepts every other room builds on
LEAF_ROOMS = {"rollout": {"traces", "sampling", "scoring", "model"},
              "trainer": {"loss", "replay", "lora"}}
ENTRY_POINTS = {"replayrl.tools.cli", "replayrl.tools.run.torchrun_entry"}  # console script / `torchrun -m`


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(["replayrl", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _layer(module: str) -> str:
    return module.split(".")[1]


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[1] == "tools" and len(parts) > 3 else None


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
    assert "replayrl.rollout.sample" in GRAPH["replayrl.trainer.ranks.trainer_actor"]
    assert "replayrl.rollout.engines.embedded" in USES["replayrl.rollout.engines"]  # registry string
    assert "replayrl.rollout.engines.embedded" not in GRAPH["replayrl.rollout.engines"]  # not imported at load
    assert "replayrl.tools.run.launcher" in GRAPH["replayrl.tools.console.repl"]  # imported inside a method
    assert len(MODULES) > 50


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_downwards(module):
    layer = _layer(module)
    bad = sorted(m for m in GRAPH[module] if _layer(m) not in ALLOWED[layer])
    if layer == "trainer":
        bad += sorted(m for m in GRAPH[module] if _layer(m) == "rollout"
                      and not m.startswith(TRAINER_MAY_USE))
    assert not bad, f"{module} imports {bad} against docs/design/layout.md#layout"


@pytest.mark.parametrize("module", sorted(m for m in MODULES
                                          if m.startswith("replayrl.trainer.backends")))
def test_trainer_backends_see_no_transport(module):
    bad = sorted(m for m in GRAPH[module] if m.startswith(TRANSPORT_DETAILS))
    assert not bad, (f"{module} imports {bad}: a backend hands its tensors to the weight sync "
                     f"(TrainerBackend.push_tensors); moving them is replayrl.rollout.weight_sync's")


def test_the_transport_rule_sees_an_import():
    # the checker itself: the trainer actor (not a backend) uses the weight-sync room
    assert any(m.startswith(TRANSPORT_DETAILS) for m in GRAPH["replayrl.trainer.ranks.trainer_actor"])


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _room(m)))
def test_tools_rooms_stand_on_the_run_only(module):
    room = _room(module)
    bad = sorted(m for m in GRAPH[module] if _layer(m) == "tools" and m != TOOLS_ERRORS
                 and (_room(m) not in ROOMS_MAY_USE[room]))
    assert not bad, f"{module} (room {room}) imports {bad}: rooms may use {ROOMS_MAY_USE[room]}"


def test_every_layer_module_is_under_the_replayrl_namespace():
    # the wheel maps each top-level folder under replayrl (pyproject.toml package-dir); a
    # bare `import tools` anywhere would only work from a source checkout
    bare = sorted(f"{name}: {m}" for name, path in MODULES.items()
                  for m in _bare_imports(path))
    assert not bare, f"imports outside the replayrl namespace: {bare}"


def _bare_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                 and node.level == 0 else [])
        found += [n for n in names if n.split(".")[0] in PACKAGES]
    return found


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
    ancestor of ``start`` (re-exports such as ``actors/__init__.py`` importing ``replayrl.actors.ref``)."""
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


def _layer_room(module: str) -> str | None:
    """``rollout/traces`` for ``replayrl.rollout.traces.trace``; None for a layer's root module."""
    parts = module.split(".")
    if parts[1] not in LAYER_ROOT_MODULES or len(parts) < 3:
        return None
    return parts[2] if (ROOT / parts[1] / parts[2]).is_dir() else None


@pytest.mark.parametrize("layer", sorted(LAYER_ROOT_MODULES))
def test_layer_roots_hold_only_their_settings_errors_and_contract(layer):
    loose = sorted(p.stem for p in (ROOT / layer).glob("*.py")
                   if p.stem != "__init__" and p.stem not in LAYER_ROOT_MODULES[layer])
    assert not loose, f"{layer}/ holds {loose} at its root: put each in the room of its concept"


@pytest.mark.parametrize("room", sorted(p.relative_to(ROOT).as_posix() for layer in LAYER_ROOT_MODULES
                                         for p in (ROOT / layer).iterdir()
                                         if p.is_dir() and (p / "__init__.py").exists()))
def test_every_room_says_what_it_holds(room):
    doc = ast.get_docstring(ast.parse((ROOT / room / "__init__.py").read_text())) or ""
    assert len(doc.split()) >= 12, f"{room}/__init__.py needs a paragraph saying what the room holds"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer_room(m)
                                          in LEAF_ROOMS.get(_layer(m), ())))
def test_leaf_rooms_stand_on_the_layer_root_only(module):
    layer, room = _layer(module), _layer_room(module)
    bad = sorted(m for m in GRAPH[module] if _layer(m) == layer and _layer_room(m) not in (None, room))
    assert not bad, f"{module} (leaf room {layer}/{room}) imports {bad} from other rooms"
