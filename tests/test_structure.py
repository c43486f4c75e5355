"""The package's shape: layers with their dependencies pointing one way, modules a reader can
take in, and no import cycles."""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ftjob"
# Sizes past which a class or function is a question for its reviewer, not a failure: one that
# grows past them is listed, with its size, in sizes.json -- a reviewed line in the diff --
# and a listed one may only shrink (its entry follows it down, and goes once it is back under).
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60
ALLOWANCES = Path(__file__).resolve().parent / "sizes.json"

# Who may import whom: a module imports its own package and the layers below it, never a
# layer above or beside it. (The command line drives the run; the driver runs workers, chaos
# and reports; those stand on data, storage and policies; everything stands on the config.)
LAYERS = {
    "cli": 4,
    "driver": 3,
    "worker": 2,
    "chaos": 2,
    "reporting": 2,
    "memory": 1.5,  # the memory tier: its protocol, and the worker's and driver's sides of it
    "data": 1,
    "storage": 1,
    "policy": 1,
    "config": 0,
    "metrics": 0,
    "record": 0.5,  # the run record: typed with config's choices, under everything that records
    "ray_internals": 0,
    "placement": 0,
    "text": 0,  # a line of text cut to fit, for every layer that prints one
}
# Top-level modules: entry points (the command line's layer) and the public names of the
# extension points users reference in their configs.
TOP_LEVEL = {
    "__main__": "cli",
    "check": "cli",
    "report": "cli",
    "datasets": "data",
    "models": "worker",
}


@functools.cache
def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "ftjob"
    return TOP_LEVEL.get(parts[1], parts[1]) if len(parts) == 2 else parts[1]


def span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined,operator]


def imports(tree: ast.Module) -> set[str]:
    """ftjob modules a module imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ftjob"):
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ftjob.")}
    return found


def test_every_module_belongs_to_a_layer():
    strays = [m for m in modules() if m != "ftjob" and layer_of(m) not in LAYERS]
    assert not strays, f"modules outside the layers {sorted(LAYERS)}: {strays}"


def test_dependencies_point_down_the_layers_never_back():
    known = modules()
    wrong = []
    for name, tree in known.items():
        if name == "ftjob":
            continue
        mine = layer_of(name)
        for target in sorted(imports(tree) & set(known)):
            theirs = layer_of(target)
            if target == "ftjob" or theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{name} ({mine}) -> {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def ray_private_uses(tree: ast.Module) -> set[str]:
    """Ray's private modules a module imports (``ray._private...``, ``ray.train.v2._internal
    ...``, ``ray.core.generated``) or reaches as attributes of ``ray`` (``ray._raylet``)."""

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] == "ray" and (
            any(p.startswith("_") for p in parts) or dotted.startswith("ray.core.generated")
        )

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and private(node.module):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if private(a.name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "ray" and node.attr.startswith("_"):
                found.add(f"ray.{node.attr}")
    return found


def test_rays_private_apis_are_used_in_one_module():
    # A Ray upgrade is then checked in ftjob.ray_internals alone.
    strays = {
        name: sorted(uses)
        for name, tree in modules().items()
        if name != "ftjob.ray_internals" and (uses := ray_private_uses(tree))
    }
    assert not strays, f"import these through ftjob.ray_internals: {strays}"


def oversized() -> dict[str, int]:
    """``module:class Name`` / ``module:def name`` -> lines, for each past its soft limit."""
    found = {}
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and span(node) > MAX_CLASS_LINES:
                found[f"{name}:class {node.name}"] = span(node)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if span(node) > MAX_FUNCTION_LINES:
                    found[f"{name}:def {node.name}"] = span(node)
    return found


def test_a_class_or_function_past_its_size_is_listed_and_only_shrinks():
    allowed = json.loads(ALLOWANCES.read_text())
    found = oversized()
    grown = [
        f"{k}: {n} lines (listed {allowed.get(k)})"
        for k, n in found.items()
        if n > allowed.get(k, 0)
    ]
    shrunk = [
        f"{k}: listed {n}, now {found.get(k, 'within the limit')}"
        for k, n in allowed.items()
        if found.get(k, 0) < n
    ]
    assert not grown, (
        f"past {MAX_CLASS_LINES} lines a class, {MAX_FUNCTION_LINES} a function: split it, or "
        f"list it in {ALLOWANCES.name} for its reviewer:\n" + "\n".join(grown)
    )
    assert not shrunk, f"lower these entries of {ALLOWANCES.name}:\n" + "\n".join(shrunk)


def test_no_import_cycle_between_ftjob_modules():
    known = modules()
    graph = {name: (imports(tree) & set(known)) - {name, "ftjob"} for name, tree in known.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, cycles[:5]


def test_the_torch_floor_has_no_known_weights_only_bypass():
    # checkpoints are restored with torch.load(weights_only=True): CVE-2025-32434 (< 2.6) and
    # CVE-2026-24747 (< 2.10) bypass it.
    import re

    text = (PACKAGE.parent / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)', text)
    vision = re.search(r'"torchvision>=0\.(\d+)', text)
    assert floor and (int(floor[1]), int(floor[2])) >= (2, 10)
    assert vision and int(vision[1]) >= 25  # torchvision 0.25 goes with torch 2.10


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists the packages by hand (conf/ ships as ftjob.conf): a new package
    missing there installs a wheel that cannot import it."""
    import tomllib

    listed = set(
        tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"][
            "packages"
        ]
    )
    found = {
        ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        for init in PACKAGE.rglob("__init__.py")
    }
    assert found <= listed, (
        f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
    )
