"""The code's shape, held as it grows: no module of the four code folders (nor of tests/ and
loadtest/) over 400 lines, no function over 60 (its docstring not counted: it explains, it does
not run), every module imported by its full name (``pagedserve.<folder>...``), no import cycle
at run time, and none even at type level (``TYPE_CHECKING`` imports included) among the modules
of one package.

Past these sizes a file or a function is asking to be split along a concept
(/work/shared/CONVENTIONS.md); a cycle inside a package means its modules are one concept
cut in the wrong place."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("server", "actors", "gpu", "kernels")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    """``{dotted name: path}`` of every module of the four code folders."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["pagedserve", *parts])] = path
    return out


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """From the ``def`` line to the last line, less the docstring's lines."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def import_edges(tree: ast.AST, name: str, names: set[str],
                 type_level: bool) -> set[str]:
    """The modules of ``names`` that ``name`` imports at module level (imports inside
    functions run later, on call); with ``type_level``, those under ``TYPE_CHECKING`` too."""
    edges: set[str] = set()

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            only = typing_only or (isinstance(child, ast.If)
                                   and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.ImportFrom) and child.module and (type_level or not only):
                for alias in child.names:
                    full = f"{child.module}.{alias.name}"
                    target = full if full in names else child.module
                    if target in names and target != name:
                        edges.add(target)
            elif isinstance(child, ast.Import) and (type_level or not only):
                edges.update(a.name for a in child.names if a.name in names and a.name != name)
            visit(child, only)

    visit(tree, False)
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return out


@pytest.fixture(scope="module")
def trees() -> dict[str, ast.AST]:
    return {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in modules().items()}


def test_no_module_over_400_lines():
    """The code folders, and the tests and benchmarks beside them (a file that long holds two
    subjects; their functions may be longer: a test reads best as one story)."""
    paths = [*modules().values(), *sorted((ROOT / "tests").rglob("*.py")),
             *sorted((ROOT / "loadtest").rglob("*.py"))]
    long = {str(path.relative_to(ROOT)): n for path in paths
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_function_over_60_lines(trees):
    long = {f"{name}:{node.lineno} {node.name}": n for name, tree in trees.items()
            for node in functions(tree) if (n := function_lines(node)) > MAX_FUNCTION_LINES}
    assert long == {}


def test_every_module_is_imported_by_its_full_name(trees):
    """``pagedserve.actors.core.scheduler``, never ``actors.core.scheduler`` (the folders are
    not top-level packages once installed) nor a relative import."""
    bad = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                bad.append(f"{name}: relative import")
            roots = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{name}: {root}" for root in roots
                    if root.split(".")[0] in FOLDERS]
    assert bad == []


def test_no_import_cycle_at_run_time(trees):
    names = set(trees)
    graph = {name: import_edges(tree, name, names, type_level=False)
             for name, tree in trees.items()}
    assert cycles(graph) == []


def test_no_import_cycle_inside_a_package_even_at_type_level(trees):
    names = set(trees)
    graph = {name: import_edges(tree, name, names, type_level=True)
             for name, tree in trees.items()}
    inside = [c for c in cycles(graph) if len({m.rpartition(".")[0] for m in c}) == 1]
    assert inside == []


def test_the_checks_see_what_they_check():
    """The measures on known code: the scheduler's module and its loop are found and sized."""
    tree = ast.parse((ROOT / "actors" / "core" / "scheduler.py").read_text(encoding="utf-8"))
    run = next(f for f in functions(tree) if f.name == "run")
    assert 10 < function_lines(run) <= MAX_FUNCTION_LINES
    assert "pagedserve.actors.core.scheduler" in modules()
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
