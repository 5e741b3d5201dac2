"""The lazy registry every name -> ``"module:attr"`` registry stands on (actors/registry.py):
a view over its owner's mapping, imported on use, each error built by the owner."""
from __future__ import annotations

import collections
import sys
from types import MappingProxyType

import pytest

from replayrl.actors.registry import LazyRegistry, import_path


class Unknown(LookupError):
    pass


class Invalid(ValueError):
    pass


def _registry(entries, **kwargs) -> LazyRegistry:
    return LazyRegistry(entries, unknown=lambda name, known: Unknown(f"{name!r} not in {known}"),
                        invalid=lambda asked, why: Invalid(f"{asked}: {why}"), **kwargs)


def test_reads_and_writes_go_to_the_owners_mapping():
    entries = {"od": "collections:OrderedDict"}
    registry = _registry(entries)
    registry["dd"] = "collections:defaultdict"  # a test's fake entry lands in the owner's dict
    assert entries == {"od": "collections:OrderedDict", "dd": "collections:defaultdict"}
    assert sorted(registry) == ["dd", "od"] and len(registry) == 2
    del registry["dd"]
    assert "dd" not in entries
    frozen = _registry(MappingProxyType({"od": "collections:OrderedDict"}))
    with pytest.raises(TypeError):
        frozen["dd"] = "collections:defaultdict"


def test_names_resolve_to_their_objects_and_refusals_use_the_owners_errors():
    registry = _registry({"od": "collections:OrderedDict", "nope": "no_such_module:X",
                          "fn": "collections:namedtuple"}, base=dict)
    assert registry.path("od") == "collections:OrderedDict"
    assert registry.resolve("od") is collections.OrderedDict
    with pytest.raises(Unknown, match=r"'x' not in fn, nope, od$"):
        registry.path("x")
    with pytest.raises(Unknown):
        registry.path(["od"])  # not a name: refused, not a TypeError of the lookup
    with pytest.raises(Invalid, match=r"^nope: no_such_module:X: No module named 'no_such_module'"):
        registry.resolve("nope")
    with pytest.raises(Invalid, match=r"^fn: collections:namedtuple is not a builtins.dict subclass"):
        registry.resolve("fn")
    with pytest.raises(Invalid, match=r"^collections:namedtuple: "):  # a path: named as itself
        registry.load("collections:namedtuple")


def test_paths_are_taken_only_when_the_owner_allows():
    assert _registry({}, paths=True).resolve("collections:OrderedDict") is collections.OrderedDict
    with pytest.raises(Unknown):
        _registry({}).path("collections:OrderedDict")
    with pytest.raises(Unknown):
        _registry({}, paths=True).path("collections")  # not of the form module:attr


def test_a_string_base_is_imported_on_the_first_load_only():
    # a base no module provides: building the registry and looking a name up import nothing
    registry = _registry({"od": "collections:OrderedDict"}, base="no_such_base_module:Base")
    assert registry.path("od") == "collections:OrderedDict"
    with pytest.raises(ValueError, match="no_such_base_module"):
        registry.resolve("od")
    assert _registry({}, base="collections:OrderedDict", paths=True).resolve(
        "collections:OrderedDict") is collections.OrderedDict


def test_a_file_path_is_run_once_as_its_own_module(tmp_path):
    file = tmp_path / "plugin.py"
    file.write_text("import dataclasses\nRUNS = []\nRUNS.append(1)\n"
                    "@dataclasses.dataclass\nclass Thing:\n    x: int = 0\n")
    thing = import_path(f"{file}:Thing")
    assert thing().x == 0 and import_path(f"{file}:Thing") is thing
    assert sys.modules[thing.__module__].RUNS == [1]
    with pytest.raises(ValueError, match=r"nowhere.py:Thing: no file"):
        import_path(f"{tmp_path / 'nowhere.py'}:Thing")
    with pytest.raises(ValueError, match=r"plugin.py:Other: .*Other"):
        import_path(f"{file}:Other")
