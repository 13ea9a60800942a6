"""The import rule of docs/architecture.md, read from its layer table: no import cycle between modules, each module
imports only from its own layer or a lower one, and a cli module imports no other cli module but the shared plumbing.

Every import counts: one inside a function is still a dependency, only a later one, and one under ``if
TYPE_CHECKING:`` is a dependency of the design (a lower layer typed against a higher one is shaped by it)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "pretrain"
DOC = ROOT / "docs" / "architecture.md"


def layer_table(text: str) -> dict[str, int]:
    """``{"recipe/": 1, "errors.py": 0, ...}`` from the doc's "| layer | holds |" table."""
    section = text.split("## The import rule", 1)[1].split("\n## ", 1)[0]
    table = {}
    for rank, cell in re.findall(r"^\| (\d+) \| ([^|]+) \|", section, re.MULTILINE):
        for name in re.findall(r"`([\w./]+)`", cell):
            table[name] = int(rank)
    return table


def shared_cli_plumbing(text: str) -> set[str]:
    """The cli modules every command may import (the rule's own line in the doc names them)."""
    section = text.split("## The import rule", 1)[1].split("\n## ", 1)[0]
    line = re.search(r"^cli plumbing: (.*)$", section, re.MULTILINE).group(1)
    return {f"pretrain.{name.removesuffix('.py').replace('/', '.').removesuffix('.__init__')}"
            for name in re.findall(r"`([\w./]+)`", line)}


def module_files() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules ``module`` imports (``from pretrain.x import y`` counts as pretrain.x.y when that is a
    module, else pretrain.x)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            names = []
        for name in names:
            if name == "pretrain" or name.startswith("pretrain."):
                target = resolve(name)
                if target and target != module:
                    found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


@cache
def graph() -> dict[str, set[str]]:
    files = module_files()
    return {module: imports_of(module, path, set(files)) for module, path in files.items()}


def layer_of(module: str, table: dict[str, int]) -> int:
    """A module's layer: its own file's row (``errors.py``), else its top folder's (``recipe/``)."""
    rel = module.removeprefix("pretrain").lstrip(".").split(".")
    if module == "pretrain":
        return table["__init__.py"]
    if len(rel) > 1 or (PACKAGE / rel[0]).is_dir():
        key = f"{rel[0]}/"
    else:
        key = f"{rel[0]}.py"
    assert key in table, f"{module}: docs/architecture.md's import rule gives {key} no layer; add it to the table"
    return table[key]


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def upward_imports(edges: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    return sorted(f"{m} (layer {layer_of(m, table)}) imports {d} (layer {layer_of(d, table)})"
                  for m, deps in edges.items() for d in deps if layer_of(d, table) > layer_of(m, table))


def cli_cross_imports(edges: dict[str, set[str]], plumbing: set[str]) -> list[str]:
    return sorted(f"{m} imports {d}" for m, deps in edges.items() if m.startswith("pretrain.cli.")
                  for d in deps if d.startswith("pretrain.cli") and d not in plumbing)


def test_the_layer_table_names_every_top_level_module_and_folder():
    table = layer_table(DOC.read_text())
    tops = {p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    tops |= {p.name for p in PACKAGE.glob("*.py")}
    assert sorted(tops - set(table)) == [], "give these a layer in docs/architecture.md's import rule"
    assert sorted(set(table) - tops) == [], "the import rule names what pretrain/ does not have"


def test_no_import_cycle_between_modules():
    assert find_cycle(graph()) is None, f"import cycle: {' -> '.join(find_cycle(graph()))}"


def test_each_module_imports_only_its_own_layer_or_lower():
    assert upward_imports(graph(), layer_table(DOC.read_text())) == []


def test_no_cli_module_imports_another_commands_logic():
    assert cli_cross_imports(graph(), shared_cli_plumbing(DOC.read_text())) == []


def test_the_rule_catches_a_violation():
    """The checks above are not vacuous: a cycle, an upward import and a cli cross-import are each found."""
    table = {"errors.py": 0, "recipe/": 1, "cli/": 9}
    assert find_cycle({"pretrain.a": {"pretrain.b"}, "pretrain.b": {"pretrain.a"}}) == ["pretrain.a", "pretrain.b",
                                                                                       "pretrain.a"]
    assert upward_imports({"pretrain.recipe.config": {"pretrain.cli.plan"}}, table) == [
        "pretrain.recipe.config (layer 1) imports pretrain.cli.plan (layer 9)"]
    assert cli_cross_imports({"pretrain.cli.slurm": {"pretrain.cli.launch", "pretrain.cli.options"}},
                             {"pretrain.cli.options"}) == ["pretrain.cli.slurm imports pretrain.cli.launch"]


def test_an_import_for_annotations_only_counts(tmp_path):
    """A lower layer typed against a higher one under ``if TYPE_CHECKING:`` is found as an upward import."""
    module = tmp_path / "layout.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pretrain.train.trainer import Trainer\n")
    assert imports_of("pretrain.distributed.layout", module, {"pretrain.train.trainer"}) == {"pretrain.train.trainer"}
