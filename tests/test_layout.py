"""The layers of src/ are its folders: docs/architecture.md's layer table names packages, bottom first, and every
import of a module goes to its own package or to a package of a lower layer; no module imports itself back through
others; src/ itself holds only the commands a user runs (``python -m src.<name>``)."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

COMMANDS = {"train", "eval", "export", "predict", "slurm_sweep"}  # python -m src.<name>: the top layer


def src_imports() -> dict[str, set[str]]:
    """Every src module and the src modules it imports, at the top or inside a function."""
    files = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (ROOT / "src").rglob("*.py")
    }
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


def layers() -> list[list[str]]:
    """docs/architecture.md's layer table, bottom first: the packages (``src/core/``) or modules of each layer."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| layer |") :].split("\n\n")[0].splitlines()[2:]
    return [re.findall(r"`src/([\w./]*)`", row.split("|")[2]) for row in table]


def package_of(module: str) -> str:
    """src.resilience.failure -> 'resilience'; src.train -> 'train' (a command is its own package)."""
    return module.split(".")[1]


def layer_of_packages() -> dict[str, int]:
    layer = {}
    for k, names in enumerate(layers()):
        for name in names:
            layer[name.rstrip("/").removesuffix(".py")] = k
    return layer


def test_every_folder_of_src_is_a_package_in_one_layer_and_src_holds_only_commands():
    table = layers()
    named = [n for row in table for n in row]
    assert len(named) == len(set(named)), f"a package is in two layers of docs/architecture.md: {named}"
    folders = {p.name for p in (ROOT / "src").iterdir() if p.is_dir() and p.name != "__pycache__"}
    loose = {p.stem for p in (ROOT / "src").glob("*.py")} - {"__init__"}
    assert loose == COMMANDS, f"src/ holds modules that are no command: {sorted(loose - COMMANDS)}"
    assert {n.rstrip("/") for row in table[:-1] for n in row} == folders, (
        "every folder of src/ is one package of a layer below the commands, and every package named is a folder"
    )
    assert {n.removesuffix(".py") for n in table[-1]} == COMMANDS, "the top layer is the commands"
    for folder in folders:
        assert (ROOT / "src" / folder / "__init__.py").is_file(), f"src/{folder}/ has no __init__.py"
        doc = ast.get_docstring(ast.parse((ROOT / "src" / folder / "__init__.py").read_text()))
        assert doc, f"src/{folder}/__init__.py says nothing of what the package answers"


def test_a_module_imports_its_own_package_and_the_layers_below_only():
    layer, graph = layer_of_packages(), src_imports()
    graph.pop("src")  # the package's __init__: it registers resolvers
    upward = [
        f"{module} imports {dep}"
        for module, imported in graph.items()
        for dep in imported
        if package_of(dep) != package_of(module) and layer[package_of(dep)] >= layer[package_of(module)]
    ]
    assert not upward, f"imports across packages that do not go down a layer: {upward}"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                found.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_src_modules_import_each_other_without_a_circle():
    graph = src_imports()
    assert "src.core.errors" in graph and not graph["src.core.errors"]  # the bottom: it imports nothing of the project
    assert circles(graph) == []


def test_the_layer_rule_and_the_circle_finder_find_what_they_look_for():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    layer = layer_of_packages()
    assert layer["core"] == 0 and layer["launch"] < layer["resilience"] < layer["cli"] < layer["train"]
    assert package_of("src.resilience.failure") == "resilience" and package_of("src.train") == "train"
