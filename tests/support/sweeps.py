"""What the sweep tests share: a cheap job to sweep, and what they read back (a job's
summary.json, the sweep's CSV, a PNG's first bytes)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


CHEAP_JOB = [
    "+experiment=digits_ft",
    "trainer.epochs=1",
    "trainer.num_workers=1",
    "dataset.val_fraction=0.9",
    "trainer.validate_every_n_steps=0",
    "trainer.checkpoint_every_n_steps=0",
]


def job_summary(sweep_dir: Path, job: str) -> dict[str, Any]:
    return json.loads((sweep_dir / job / "summary.json").read_text())
