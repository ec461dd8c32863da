"""The package's import graph, read from the source (every import that runs, those inside
functions too; not those under `if TYPE_CHECKING:`):
prr's modules form no cycle (runner, graph_run, config_check and evaluation once did), and
kernels/ (installed as prr.kernels) imports nothing from the rest of prr."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for prr/ and kernels/ (as prr.kernels)."""
    out = {}
    for base, package in ((ROOT / "prr", ("prr",)), (ROOT / "kernels", ("prr", "kernels"))):
        for path in base.rglob("*.py"):
            parts = package + path.relative_to(base).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """Nodes under `if TYPE_CHECKING:` (imports for annotations only: they never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {n for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The prr modules `path` imports (`from a.b import c` names a.b.c when that is a module)."""
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = type_checking_only(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found |= {n if n in modules else node.module for n in names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in modules}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_prr_modules_import_each_other_without_cycles():
    modules = module_files()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    assert cycles(graph) == []


def test_cycles_finds_a_cycle():  # the check above can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_kernels_import_nothing_from_the_rest_of_prr():
    modules = module_files()
    outside = {name: sorted(m for m in imports_of(path, modules) if not m.startswith("prr.kernels"))
               for name, path in modules.items() if name.startswith("prr.kernels")}
    assert {name: deps for name, deps in outside.items() if deps} == {}
