"""benchmarks/ stands on its own helpers: no benchmark imports from tests/ (what both need lives in
`ndparallel.test_utils`), and what every benchmark shares is written once, in benchmarks/common.py -- the memory
readers (the resident set from /proc, glibc's mallopt), the layouts (the library's `Layout`), and every class and
function common.py defines. Read from the source (ast), nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS, TESTS = ROOT / "benchmarks", ROOT / "tests"
HELPERS = "common.py"
# Memory read straight from the system (in code, not in prose): only common.py does it (rss_bytes, peak_rss_bytes,
# reset_peak_rss, serve_large_blocks_from_mmap).
MEMORY_READS = ("/proc/self/status", "/proc/self/statm", "/proc/self/clear_refs", "ru_maxrss", "mallopt")


def _test_modules() -> set[str]:
    """Module names a script could import from tests/ once a folder of it is on sys.path (none that benchmarks/ has)."""
    return {p.stem for p in TESTS.rglob("*.py")} - {p.stem for p in BENCHMARKS.glob("*.py")} - {"__init__", "conftest"}


def _defined(tree: ast.Module) -> set[str]:
    return {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}


def violations(name: str, source: str, test_modules: set[str], shared: set[str]) -> list[str]:
    """What benchmark file `name` (its `source`) does that it must not."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"imports {a.name} from tests/" for a in node.names if a.name.split(".")[0] in test_modules]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in test_modules:
                found.append(f"imports from {node.module} (tests/)")
        elif isinstance(node, (ast.Expr, ast.Assign, ast.AugAssign)) and not isinstance(node.value, ast.Constant):
            code = ast.unparse(node)  # a statement of code (not a docstring)
            if "sys.path" in code and "tests" in code.lower():
                found.append(f"puts tests/ on sys.path: {code}")
        if isinstance(node, ast.ClassDef) and node.name == "Layout":
            found.append("defines a class Layout (the layout is ndparallel.distributed.layout.Layout)")
    if name != HELPERS:
        docstrings = {id(n.value) for n in ast.walk(tree)
                      if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        code = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and id(n) not in docstrings]
        code += [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
        found += [f"reads memory itself ({what}): use common.py's readers" for what in MEMORY_READS
                  if any(what in c for c in code)]
        found += [f"defines {n} again (common.py has it)" for n in sorted(_defined(tree) & shared)]
    return found


def test_no_benchmark_imports_tests_or_repeats_the_shared_helpers():
    shared = _defined(ast.parse((BENCHMARKS / HELPERS).read_text()))
    test_modules = _test_modules()
    assert {"harness", "reference", "step_costs", "tiny_models"} <= test_modules  # what benchmarks used to import
    found = {p.name: v for p in sorted(BENCHMARKS.glob("*.py"))
             if (v := violations(p.name, p.read_text(), test_modules, shared))}
    assert not found, f"benchmarks that import tests/ or repeat common.py: {found}"


def test_every_benchmark_program_uses_the_helper_module():
    """Each program (a file with a ``__main__`` block) imports common.py, or a module of benchmarks/ that does."""
    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    local = {p.stem: imports(p) for p in BENCHMARKS.glob("*.py")}
    users = {"common"}
    while True:  # the modules that reach common.py through other benchmark modules
        more = {name for name, used in local.items() if used & users} - users
        if not more:
            break
        users |= more
    programs = [p.stem for p in BENCHMARKS.glob("*.py") if "__main__" in p.read_text()]
    # Those that need none of it: they launch whole training runs and read their logs (goodput, soak), ask the planner
    # only (alst_compare, planner_published), time the agreement checks on the example's model (agreement), or
    # measure one attention layer with ndparallel.test_utils's counters (sequence_parallel, ulysses_head_chunks).
    assert sorted(set(programs) - users) == ["agreement", "alst_compare", "goodput", "planner_published",
                                             "sequence_parallel", "soak", "ulysses_head_chunks"]


def test_the_check_catches_planted_violations():
    """The check fails on each thing it forbids (and passes the same file without it)."""
    tests, shared = _test_modules(), {"llama", "SavedActivations"}
    planted = {
        "from harness import run_ranks": "imports from harness",
        "import tiny_models": "imports tiny_models",
        "sys.path.insert(0, str(ROOT / 'tests'))": "puts tests/ on sys.path",
        "sys.path[:0] = [str(TESTS)]": "puts tests/ on sys.path",
        "sys.path.append('/repo/tests/scripts')": "puts tests/ on sys.path",
        "class Layout:\n    pass": "defines a class Layout",
        "def _rss():\n    return open('/proc/self/status').read()": "reads memory itself (/proc/self/status)",
        "import ctypes\nctypes.CDLL('libc.so.6').mallopt(-3, 1 << 16)": "reads memory itself (mallopt)",
        "class SavedActivations:\n    pass": "defines SavedActivations again",
        "def llama():\n    pass": "defines llama again",
    }
    for code, message in planted.items():
        found = violations("x.py", "import sys\n" + code + "\n", tests, shared)
        assert any(message in f for f in found), (code, found)
    fine = '"""Not tests/harness.py: sys.path gets no tests/ folder."""\nimport sys\nfrom common import llama\n'
    assert violations("x.py", fine + "from ndparallel.test_utils import run_ranks\n", tests, shared) == []
    assert violations(HELPERS, "def llama():\n    return open('/proc/self/status')\n", tests, shared) == []
