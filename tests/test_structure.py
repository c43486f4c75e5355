"""The package's shape: layers with their dependencies pointing one way, modules a reader can
take in, and no import cycles.

Size is a signal here, not a gate. Every run of these tests reports the largest classes and
functions and each one past the review sizes (:class:`SizeReport`, in pytest's warnings
summary), so a reviewer sees what a change made long. Nothing fails for crossing them: a cap
that fails at 60 lines gathered functions at 57 to 60, made so by cramming assignments onto one
line or splitting a function that reads top to bottom (a worker's attempt, a run's start) into
helpers that each take half its locals -- shorter, and harder to read. What fails is growth a
reviewer already weighed: a class or function listed in sizes.json, with its size, may not grow
past it; its entry is raised in the same diff, for its reviewer, or it is split. An entry its
code has shrunk below, or that names nothing, is reported for lowering or removal.
"""

from __future__ import annotations

import ast
import functools
import json
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ftjob"
MAX_CLASS_LINES = 300  # review sizes: past them, a class or function is named in every report
MAX_FUNCTION_LINES = 60
LARGEST = 8  # of each kind, named in every report
ALLOWANCES = Path(__file__).resolve().parent / "sizes.json"


class SizeReport(UserWarning):
    """The package's largest classes and functions, and those past the review sizes."""


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
    "placement": 0.25,  # starts ftjob's actors, typed as ftjob.actors types them
    "actors": 0,  # calls to ftjob's Ray actors, checked against the actor's class
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


def sizes() -> dict[str, int]:
    """``module:class Name`` / ``module:def Name.name`` -> lines, for every class and function
    (named as Python's qualified names name them, without ``<locals>``)."""
    found: dict[str, int] = {}

    def visit(module: str, node: ast.AST, outer: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                kind = "class" if isinstance(child, ast.ClassDef) else "def"
                name = f"{outer}{child.name}"
                key = f"{module}:{kind} {name}"
                found[key] = max(found.get(key, 0), span(child))
                visit(module, child, f"{name}.")
            else:
                visit(module, child, outer)

    for module, tree in modules().items():
        visit(module, tree, "")
    return found


def size_report(found: dict[str, int], listed: dict[str, int]) -> str:
    """The largest ``LARGEST`` classes and functions, every one past its review size (marked
    ``listed N`` where sizes.json holds it), and the entries of sizes.json to lower or drop."""

    def cap(key: str) -> int:
        return MAX_CLASS_LINES if ":class " in key else MAX_FUNCTION_LINES

    lines = []
    for kind, label in (("class", "classes"), ("def", "functions")):
        ranked = sorted((k for k in found if f":{kind} " in k), key=lambda k: (-found[k], k))
        shown = [k for i, k in enumerate(ranked) if i < LARGEST or found[k] > cap(k)]
        lines.append(f"largest {label} (past {cap(f':{kind} ')} lines: *):")
        for key in shown:
            mark = "*" if found[key] > cap(key) else " "
            note = f" (listed {listed[key]})" if key in listed else ""
            lines.append(f"  {mark} {found[key]:4d}  {key}{note}")
    for key, n in sorted(listed.items()):
        if found.get(key, 0) < n:
            now = f"now {found[key]}" if key in found else "it is gone"
            lines.append(f"sizes.json lists {key} at {n}, {now}: lower or remove its entry")
    return "\n".join(lines)


def grown(found: dict[str, int], listed: dict[str, int]) -> list[str]:
    """The listed classes and functions now longer than their entries."""
    return [f"{k}: {found[k]} lines, listed {n}" for k, n in listed.items() if found.get(k, 0) > n]


def test_sizes_are_reported_and_a_listed_size_only_shrinks():
    listed = json.loads(ALLOWANCES.read_text())
    found = sizes()
    report = "sizes of ftjob's code, in lines\n" + size_report(found, listed)
    warnings.warn(SizeReport(report), stacklevel=1)
    too_long = grown(found, listed)
    assert not too_long, (
        f"a reviewer weighed these at their size in {ALLOWANCES.name}: split them, or raise "
        "their entries in this diff for review:\n" + "\n".join(too_long)
    )


def test_the_size_report_names_the_largest_what_is_past_the_review_sizes_and_stale_entries():
    found = {f"m:def f{i}": 10 + i for i in range(LARGEST + 2)}
    found |= {"m:def long": MAX_FUNCTION_LINES + 5, "m:class C": 40, "m:def listed": 70}
    listed = {"m:def listed": 75, "m:def removed": 90, "m:class C": 40}
    report = size_report(found, listed)
    assert f"* {MAX_FUNCTION_LINES + 5:4d}  m:def long" in report
    assert "*   70  m:def listed (listed 75)" in report
    assert "m:class C (listed 40)" in report and "m:def f0" not in report  # not among the largest
    assert "lists m:def listed at 75, now 70: lower" in report
    assert "lists m:def removed at 90, it is gone" in report
    assert grown(found, listed) == []
    assert grown(found | {"m:class C": 41}, listed) == ["m:class C: 41 lines, listed 40"]


def test_a_type_ignore_names_its_error_and_says_why():
    """The type checker is told to look away only with the error it would report and, on the
    same line, why it cannot see what is there (``# type: ignore[code]  # why``)."""
    import re

    said = re.compile(r"# type: ignore\[[a-z-]+(, [a-z-]+)*\]  # \S")
    silent = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "type: ignore" in line and not said.search(line)
    ]
    assert not silent, f"say which error and why: {silent}"


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
