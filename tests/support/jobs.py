"""Composing a job as ``python -m ftjob`` would, without a Hydra run dir."""

from __future__ import annotations

from typing import Any


def compose_job(*overrides: str) -> Any:
    """The JobConfig ``python -m ftjob`` would run with these overrides (no Hydra run dir)."""
    from hydra.core.global_hydra import GlobalHydra

    from ftjob.config import load_job
    from ftjob.config.compose import Composer, Target

    try:
        return load_job(Composer().compose(Target("test"), overrides))
    finally:
        GlobalHydra.instance().clear()
