"""Tier 1: the import structure of `src/ndparallel` has no cycle, and no import inside a function hides one.

The graph is read from the source (ast), not by importing: an edge A -> B for every ``import`` / ``from ... import``
in module A that executes module B, B's packages included (importing ``ndparallel.parallel.sequence.layout`` runs
``ndparallel.parallel`` and ``ndparallel.parallel.sequence`` first), except A's own packages, which are already being
imported when A runs -- unless A takes a name they define (``from .. import __version__``), which needs them run. Imports at module level (outside ``if TYPE_CHECKING:``) are the graph; imports inside functions
are allowed only where adding them to the graph still leaves no cycle -- that is, where they are not needed to break
one (the CLI defers heavy imports to keep ``ndparallel --help`` fast, for instance).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "ndparallel"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _executed(target: str) -> set[str]:
    """`target` and its packages: what importing it runs (internal modules only)."""
    return {m for m in _ancestors(target) | {target} if m in MODULES}


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """Internal modules an import statement in `module` executes, or needs executed."""
    mine = _ancestors(module) | {module}
    if isinstance(node, ast.Import):
        return {m for alias in node.names if alias.name.split(".")[0] == PACKAGE for m in _executed(alias.name)} - mine
    if node.level:
        base = module.split(".") if _is_package(module) else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    if prefix.split(".")[0] != PACKAGE:
        return set()
    out: set[str] = set()
    for alias in node.names:
        if f"{prefix}.{alias.name}" in MODULES:  # a submodule: it runs (and the packages above it)
            out |= _executed(f"{prefix}.{alias.name}") - mine
        else:  # a name defined by `prefix`: it must have run that far, even when it is one of our own packages
            out |= (_executed(prefix) - mine) | ({prefix} - {module})
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(module-level targets, targets of imports inside functions) of `module`."""
    tree = ast.parse(MODULES[module].read_text())
    top: set[str] = set()
    nested: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and not in_function and _is_type_checking(child):
                continue  # never executed
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (nested if in_function else top).update(_targets(module, child))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return top, nested


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


GRAPH = {m: _imports(m) for m in MODULES}


def test_the_graph_reader_sees_the_package():
    assert len(MODULES) > 30
    top, _ = GRAPH["ndparallel.accelerator.core"]
    assert {"ndparallel.config", "ndparallel.parallel", "ndparallel.parallel.sequence", "ndparallel.mesh"} <= top
    # a relative import from a package's __init__ resolves inside that package
    assert "ndparallel.parallel.sequence.apply" in GRAPH["ndparallel.parallel.sequence"][0]
    def targets(module: str, statement: str) -> set[str]:
        return _targets(module, ast.parse(statement).body[0])

    assert targets("ndparallel.checkpoint.training_state", "from .. import __version__") == {"ndparallel"}
    assert targets("ndparallel.checkpoint.training_state", "from . import storage") == {"ndparallel.checkpoint.storage"}
    assert targets("ndparallel.checkpoint.training_state", "from ..parallel.sequence import SequenceShards") == {
        "ndparallel.parallel", "ndparallel.parallel.sequence"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_import_cycle_at_module_level():
    cycle = _cycle({m: top for m, (top, _) in GRAPH.items()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", [m for m, (_, nested) in GRAPH.items() if nested])
def test_no_function_level_import_hides_a_cycle(module):
    graph = {m: set(top) for m, (top, _) in GRAPH.items()}
    graph[module] |= GRAPH[module][1]
    cycle = _cycle(graph)
    assert cycle is None, f"{module} imports inside a function to break the cycle " + " -> ".join(cycle)
