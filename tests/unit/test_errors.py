"""The exception tree of docs/design/errors.md#errors, read from the source with ``ast``.

- every exception class of a production module is declared in a module named ``errors.py``;
- no exception class name is declared twice;
- each class has at most one project base, and sits at most two levels below its layer's base.
"""
from __future__ import annotations

import ast
import builtins
from pathlib import Path

from tests.paths import REPO

ROOT = REPO
PACKAGES = ("transport", "actors", "rollout", "trainer", "tools")  # the layers' folders
LAYER_BASES = {"transport": "TransportError", "actors": "ActorError", "rollout": "RolloutError",
               "trainer": "TrainerError", "tools": "ToolsError"}
# Exceptions outside their layer's tree on purpose: SIGTERM must unwind like Ctrl-C.
OUTSIDE_TREE = {"Terminated"}
BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)}


def _classes() -> list[tuple[str, str, list[str]]]:
    """(path relative to ROOT, class name, base names) of every class in every production
    module, nested classes included."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                    found.append((rel, node.name, bases))
    return found


CLASSES = _classes()


def _exceptions() -> dict[str, list[tuple[str, list[str]]]]:
    """Exception class name -> [(path, bases)] for every declaration: a class whose bases
    include a builtin exception or, transitively, another exception class of the project."""
    by_name: dict[str, list[tuple[str, list[str]]]] = {}
    for rel, name, bases in CLASSES:
        by_name.setdefault(name, []).append((rel, bases))
    exc: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, decls in by_name.items():
            if name not in exc and any(b in BUILTIN_EXCEPTIONS or b in exc
                                       for _, bases in decls for b in bases):
                exc.add(name)
                grew = True
    return {name: by_name[name] for name in sorted(exc)}


EXCEPTIONS = _exceptions()


def test_the_scan_sees_the_known_classes():
    # a guard against a scan that finds nothing: classes named in docs/design/errors.md#errors
    for name in ("TransportError", "ActorError", "RolloutError", "TrainerError", "ToolsError",
                 "RemoteError", "SampleError", "ConfigError", "Terminated", "ModelError"):
        assert name in EXCEPTIONS, name
    assert len(EXCEPTIONS) > 60


def test_every_exception_class_is_declared_in_an_errors_module():
    stray = sorted(f"{rel}: {name}" for name, decls in EXCEPTIONS.items() for rel, _ in decls
                   if Path(rel).name != "errors.py")
    assert not stray, "exception classes outside an errors.py:\n" + "\n".join(stray)


def test_no_exception_class_name_is_declared_twice():
    twice = {name: [rel for rel, _ in decls] for name, decls in EXCEPTIONS.items()
             if len(decls) > 1}
    assert not twice, f"exception classes declared more than once: {twice}"


def test_each_exception_has_one_project_base_and_a_shallow_place_in_its_layer():
    problems = []
    for name, decls in EXCEPTIONS.items():
        for rel, bases in decls:
            project = [b for b in bases if b in EXCEPTIONS]
            if len(project) > 1:
                problems.append(f"{rel}: {name} has two project bases {project}")
                continue
            if name in OUTSIDE_TREE:
                continue
            layer_base = LAYER_BASES[rel.split("/")[0]]
            chain = [name]
            while chain[-1] != layer_base:
                parents = [b for rel_, bs in EXCEPTIONS.get(chain[-1], []) for b in bs
                           if b in EXCEPTIONS] or [""]
                parent = parents[0]
                if not parent or parent in chain:
                    problems.append(f"{rel}: {name} does not derive from {layer_base} "
                                    f"(chain {' -> '.join(chain)})")
                    break
                chain.append(parent)
            else:
                if len(chain) - 1 > 2:
                    problems.append(f"{rel}: {name} is {len(chain) - 1} levels below "
                                    f"{layer_base} ({' -> '.join(chain)})")
    assert not problems, "\n".join(problems)


def test_each_layer_base_is_a_plain_exception():
    for layer, base in LAYER_BASES.items():
        decls = EXCEPTIONS[base]
        assert decls == [(f"{layer}/errors.py", ["Exception"])], (base, decls)
