"""Run names: what a ``name`` may be, since it becomes a directory of the run's storage and of
every node's scratch."""

from __future__ import annotations

import re

from ftjob.config.rules import require

# A run name must never climb out of its directories (``..``), hide (``.x``), or be expanded as
# a glob pattern (``[``, ``*``, ``?``).
RUN_NAME = re.compile(r"(?!\.)[A-Za-z0-9._-]{1,128}")


def validate_run_name(name: str | None, key: str = "name") -> None:
    """Refuse a run name outside the safe set (letters, digits, ``._-``; not starting with a
    dot; 1-128 characters)."""
    require(
        name is None or (isinstance(name, str) and RUN_NAME.fullmatch(name) is not None),
        "",
        key,
        name,
        "a run name is 1-128 letters, digits, '.', '_' or '-', not starting with '.' "
        "(it names directories of the run's storage): choose e.g. name=exp-1",
    )
