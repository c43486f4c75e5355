"""docs/ARCHITECTURE.md is the map, kept true to the code: every package a row naming each of
its modules, every top-level module named, and the levels it counts those of
``tests/test_structure.py``'s ``LAYERS``."""

from __future__ import annotations

import re

from tests.test_structure import LAYERS, PACKAGE

DOC = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
NUMBERS = {5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten", 11: "eleven"}


def package_row(package: str) -> str:
    found = re.search(rf"^\| `{package}/` \|(.*)$", DOC, re.M)
    assert found, f"docs/ARCHITECTURE.md has no row for {package}/"
    return found.group(1)


def test_every_module_is_on_the_map() -> None:
    missing = []
    for directory in sorted(p for p in PACKAGE.iterdir() if p.is_dir() and p.name in LAYERS):
        row = package_row(directory.name)
        for module in sorted(directory.rglob("*.py")):
            if module.stem != "__init__" and f"`{module.stem}`" not in row:
                missing.append(str(module.relative_to(PACKAGE.parent)))
    for module in sorted(PACKAGE.glob("*.py")):
        if module.stem not in ("__init__", "__main__") and module.stem not in DOC:
            missing.append(str(module.relative_to(PACKAGE.parent)))
    assert not missing, f"modules docs/ARCHITECTURE.md does not name: {missing}"


def test_the_map_counts_the_packages_and_levels_there_are() -> None:
    packages = [p for p in PACKAGE.iterdir() if p.is_dir() and p.name in LAYERS]
    levels = len(set(LAYERS.values()))
    intro = DOC.split("```", 1)[0]
    assert f"{NUMBERS[len(packages)]} packages" in intro, intro
    assert f"{NUMBERS[levels]} levels" in intro, intro
    for name, level in LAYERS.items():  # the picture gives each its level
        assert re.search(rf"^{re.escape(f'{level:g}')}\s.*\b{name}\b", DOC, re.M), name
