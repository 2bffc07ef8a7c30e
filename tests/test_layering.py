"""The imports run one way: facades -> context -> communicators -> torch, never back up, and no circles between files.

The modules are read, not imported: every ``import`` of ``rlightning_comm`` in a module (at its top or inside a
function, ``TYPE_CHECKING`` blocks aside) is an edge of the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlightning_comm"

# The layers, lowest first. A module may import from a lower layer, or from its own package; the leaves (layer 0) may
# import each other (the cycle test keeps that one way).
LAYERS = {
    0: {"_compat", "_env", "_shutdown", "errors", "modes", "config", "failures", "rendezvous", "topology", "bandwidth"},
    1: {"communicators"},
    2: {"debug", "stats", "connect"},
    3: {"context"},
    4: {"sequence_parallel", "weights", "layout", "launch"},
    5: {"collective"},
    6: {"bench", "integrations"},
    7: {"cli"},
    8: {"__init__"},
}
LAYER_OF = {name: layer for layer, names in LAYERS.items() for name in names}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["rlightning_comm", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlightning_comm"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in mods else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("rlightning_comm"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in mods}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, mods) - {m} for m, p in mods.items()}


def test_every_module_has_a_layer():
    unplaced = sorted({_package(m) for m in _graph()} - set(LAYER_OF))
    assert not unplaced, f"place these in LAYERS (tests/test_layering.py): {unplaced}"


def test_no_module_imports_a_layer_above_it():
    wrong = []
    for module, targets in _graph().items():
        own = _package(module)
        for target in targets:
            other = _package(target)
            if other == own or other == "__init__" and own == "__init__":
                continue
            mine, theirs = LAYER_OF.get(own, -1), LAYER_OF.get(other, -1)
            if theirs > mine or (theirs == mine and mine != 0):
                wrong.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_circles_between_files():
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                dfs(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node, [])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_the_reader_sees_function_level_imports_and_skips_type_checking(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rlightning_comm.context import CommContext\n"
        "def f():\n    from rlightning_comm.errors import CommError\n"
    )
    mods = {"rlightning_comm.context": src, "rlightning_comm.errors": src}
    assert _imports(src, mods) == {"rlightning_comm.errors"}
