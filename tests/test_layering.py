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
    0: {"_compat", "_env", "errors", "modes", "config", "failures", "rendezvous", "topology", "bandwidth"},
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


# The rooms of ``weights``, lowest first: a module of a room imports from its own room or a lower layer's, never from a
# room of its layer or above (the package's own modules, its public face, sit on top).
WEIGHT_ROOMS = {
    0: {"core"},
    1: {"commit", "delta"},
    2: {"broadcast", "reshard"},
    3: {"layouts", "engines"},
    4: {"__init__"},
}
ROOM_OF = {name: layer for layer, names in WEIGHT_ROOMS.items() for name in names}


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["rlightning_comm", "weights"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def test_every_module_of_weights_is_in_a_room():
    unplaced = sorted({_room(m) for m in _graph()} - {None} - set(ROOM_OF))
    assert not unplaced, f"place these in WEIGHT_ROOMS (tests/test_layering.py): {unplaced}"


def test_the_rooms_of_weights_import_one_way():
    wrong = []
    for module, targets in _graph().items():
        own = _room(module)
        if own is None:
            continue
        for target in targets:
            other = _room(target)
            if other is None or other == own:
                continue
            mine, theirs = ROOM_OF.get(own, -1), ROOM_OF.get(other, -1)
            if theirs >= mine:
                wrong.append(f"{module} (room {own}, layer {mine}) imports {target} (room {other}, layer {theirs})")
    assert not wrong, "\n".join(sorted(wrong))


def _private_imports(path: Path, package: str) -> list[str]:
    """Every name starting with ``_`` that ``path`` imports from ``package`` or below it, and every module of it whose
    path has a component starting with ``_`` (``TYPE_CHECKING`` blocks included: an annotation is a dependency too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            below = node.module[len(package) :].split(".")
            if any(part.startswith("_") for part in below if part):
                found.append(f"from {node.module} import ...")
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [
                f"import {a.name}"
                for a in node.names
                if a.name.startswith(package) and any(p.startswith("_") for p in a.name[len(package) :].split(".") if p)
            ]
    return found


def test_integrations_use_only_public_names_of_weights():
    wrong = {
        str(path.relative_to(PACKAGE)): found
        for path in sorted((PACKAGE / "integrations").rglob("*.py"))
        if (found := _private_imports(path, "rlightning_comm.weights"))
    }
    assert not wrong, wrong


def test_the_private_import_reader_finds_private_modules_and_names(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from rlightning_comm.weights import layouts, _x\n"
        "from rlightning_comm.weights.reshard._call import reshard\n"
        "import rlightning_comm.weights.commit._sync\n"
        "from rlightning_comm.weights.engines import refuse_reshard\n"
    )
    assert _private_imports(src, "rlightning_comm.weights") == [
        "from rlightning_comm.weights import _x",
        "from rlightning_comm.weights.reshard._call import ...",
        "import rlightning_comm.weights.commit._sync",
    ]


def test_no_file_of_the_library_passes_350_lines():
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 350
    }
    assert not long, long


def test_the_top_level_has_at_most_14_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 14, top


def test_the_reader_sees_function_level_imports_and_skips_type_checking(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rlightning_comm.context import CommContext\n"
        "def f():\n    from rlightning_comm.errors import CommError\n"
    )
    mods = {"rlightning_comm.context": src, "rlightning_comm.errors": src}
    assert _imports(src, mods) == {"rlightning_comm.errors"}
