"""How the project's modules depend on each other: no import circles (errors at the bottom, entry points on top)."""

from __future__ import annotations

import ast

from tests.conftest import ROOT


def src_imports() -> dict[str, set[str]]:
    """Every src module and the src modules it imports, at the top or inside a function."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "src").rglob("*.py")}
    graph = {}
    for module, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "src":
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    imported.add(name if name in files else node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name.split(".")[0] == "src")
        graph[module] = imported - {module, "src"}  # a submodule always runs src/__init__ first: not a circle
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_src_modules_import_each_other_without_a_circle():
    graph = src_imports()
    assert "src.errors" in graph and not graph["src.errors"]  # the bottom: it imports nothing of the project
    assert circles(graph) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
