"""The package's shape: modules a reader can take in, and no import cycles between them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ftjob"
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, ast.Module]:
    return {
        f"ftjob.{path.stem}": ast.parse(path.read_text(), str(path))
        for path in sorted(PACKAGE.glob("*.py"))
        if path.stem != "__init__"
    }


def span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined,operator]


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_class_or_function_outgrows_what_a_reader_holds_in_mind(name):
    too_long = []
    for node in ast.walk(modules()[name]):
        if isinstance(node, ast.ClassDef) and span(node) > MAX_CLASS_LINES:
            too_long.append(f"class {node.name}: {span(node)} lines")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if span(node) > MAX_FUNCTION_LINES:
                too_long.append(f"def {node.name}: {span(node)} lines")
    assert not too_long, f"{name}: {too_long}"


def imports(tree: ast.Module) -> set[str]:
    """ftjob modules a module imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ftjob"):
            if node.module == "ftjob":
                found |= {f"ftjob.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ftjob.")}
    return found


def test_no_import_cycle_between_ftjob_modules():
    graph = {name: imports(tree) & set(modules()) for name, tree in modules().items()}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif len(path) < len(graph):
                visit(nxt, [*path, nxt])

    for start in graph:
        visit(start, [start])
    assert not cycles, cycles[:5]
