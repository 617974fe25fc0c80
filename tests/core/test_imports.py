"""Tier 1: the import structure of `src/ndparallel` has no cycle -- imports inside functions and under
``if TYPE_CHECKING:`` included.

The graph is read from the source (ast), not by importing: an edge A -> B for every ``import`` / ``from ... import``
in module A that executes module B, B's packages included (importing ``ndparallel.parallel.sequence.positions`` runs
``ndparallel.parallel`` and ``ndparallel.parallel.sequence`` first), except A's own packages, which are already being
imported when A runs -- unless A takes a name they define (``from .. import __version__``), which needs them run.

The whole graph -- imports at module level, inside functions, and under ``if TYPE_CHECKING:`` together -- has no
cycle: an import inside a function may defer a heavy module (the CLI keeps ``ndparallel --help`` fast so), never
break a cycle, and a type checker sees the same acyclic graph as the interpreter.
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


def _imports(module: str, source: str | None = None) -> tuple[set[str], set[str], set[str]]:
    """(module-level targets, targets of imports inside functions, targets under ``if TYPE_CHECKING:``) of
    `module` (read from its file, or `source`)."""
    tree = ast.parse(MODULES[module].read_text() if source is None else source)
    top: set[str] = set()
    nested: set[str] = set()
    typing_only: set[str] = set()

    def visit(node: ast.AST, where: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.If) and where is top and _is_type_checking(child):
                inner = typing_only  # never executed; its else branch is
                for branch in child.orelse:
                    visit(ast.Module(body=[branch], type_ignores=[]), top)
                child = ast.Module(body=child.body, type_ignores=[])
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                where.update(_targets(module, child))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and where is top:
                inner = nested
            visit(child, inner)

    visit(tree, top)
    return top, nested, typing_only


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
    top, _, _ = GRAPH["ndparallel.accelerator.core"]
    assert {"ndparallel.configuration", "ndparallel.parallel", "ndparallel.parallel.sequence", "ndparallel.distributed.mesh"} <= top
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


def test_the_graph_reader_sorts_imports_by_where_they_run():
    source = """
from typing import TYPE_CHECKING
from . import launcher
if TYPE_CHECKING:
    from . import worker
else:
    from . import arguments
def f():
    from .. import planner
class C:
    def g(self):
        from . import schedulers
"""
    top, nested, typing_only = _imports("ndparallel.launch.cli", source)
    assert top == {"ndparallel.launch.launcher", "ndparallel.launch.arguments"}
    assert nested == {"ndparallel.planner", "ndparallel.launch.schedulers"}
    assert typing_only == {"ndparallel.launch.worker"}


def test_no_import_cycle_at_module_level():
    cycle = _cycle({m: top for m, (top, _, _) in GRAPH.items()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_in_the_whole_graph():
    """Module-level, function-level and TYPE_CHECKING imports together: none of them hides a cycle."""
    cycle = _cycle({m: top | nested | typing_only for m, (top, nested, typing_only) in GRAPH.items()})
    assert cycle is None, "import cycle (imports inside functions and TYPE_CHECKING included): " + " -> ".join(cycle)
