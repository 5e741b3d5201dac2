"""Every JSON the project writes goes through the one strict writer
(``replayrl.transport.strict_json``, never ``NaN`` / ``Infinity``): production code calls no
``json.dump`` / ``json.dumps`` directly and no ``aiohttp`` JSON response without its ``dumps``
(docs/design/transport.md#transport-contract, "JSON")."""
from __future__ import annotations

import ast

from tests.paths import REPO

LAYERS = ("transport", "actors", "rollout", "trainer", "tools")
WRITER = REPO / "transport" / "strict_json.py"


def direct_writers(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` of each JSON write that bypasses the strict writer in ``tree``:
    ``<json module>.dump(s)(...)``, ``from json import dump(s)`` and ``json_response(...)``
    without ``dumps=``."""
    modules = {"json"}  # names bound to the json module (import json as j)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name == "json")
        elif isinstance(node, ast.ImportFrom) and node.module == "json":
            found += [(node.lineno, f"from json import {a.name}") for a in node.names
                      if a.name in ("dump", "dumps")]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func = node.func
        if (func.attr in ("dump", "dumps") and isinstance(func.value, ast.Name)
                and func.value.id in modules):
            found.append((node.lineno, f"{func.value.id}.{func.attr}(...)"))
        if func.attr == "json_response" and not any(k.arg == "dumps" for k in node.keywords):
            found.append((node.lineno, "json_response(...) without dumps="))
    return sorted(found)


def test_the_scan_finds_each_kind_of_direct_write():
    source = ("import json\nimport json as j\nfrom json import dumps\nfrom aiohttp import web\n"
              "json.dumps(1)\nj.dump(1, f)\nweb.json_response({})\n"
              "web.json_response({}, dumps=strict_json.dumps)\nstrict_json.dumps(1)\njson.loads('1')\n")
    assert direct_writers(ast.parse(source)) == [
        (3, "from json import dumps"), (5, "json.dumps(...)"), (6, "j.dump(...)"),
        (7, "json_response(...) without dumps=")]


def test_production_code_writes_json_only_through_strict_json():
    files = [p for layer in LAYERS for p in sorted((REPO / layer).rglob("*.py")) if p != WRITER]
    assert len(files) > 100  # the layers were found
    offenders = [f"{p.relative_to(REPO)}:{line}: {what}" for p in files
                 for line, what in direct_writers(ast.parse(p.read_text(), str(p)))]
    assert not offenders, "write JSON with replayrl.transport.strict_json.dumps:\n" + "\n".join(offenders)
