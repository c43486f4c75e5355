"""Exact mode's references: the final weights of a run, and those of the unkilled world-2 run
of a job, computed in this process (tests/support/local_run.py), that a run at any world size,
resized or killed, must equal bit for bit (``trainer.exact=true``)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from ftjob.storage.checkpoint import checkpoint_file
from tests.support.jobs import compose_job
from tests.support.local_run import run_locally


def final_weights(summary: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's state dict -- weights and buffers (BatchNorm's running statistics) -- of a
    run's final checkpoint: ``model.pt`` of summary.json's ``checkpoints.latest``, read through
    its manifest (the stored object has its writer's own name) and checked against its SHA-256."""
    model = checkpoint_file(summary["checkpoints"]["latest"], "model.pt")
    return torch.load(io.BytesIO(model), weights_only=True)


def differing(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are not bit for bit equal (or present in one state only)."""
    names = sorted(set(expected) | set(got))
    return [
        n
        for n in names
        if n not in expected or n not in got or not torch.equal(expected[n], got[n])
    ]


def unkilled_reference(
    run_dir: Path, *overrides: str, experiment: str = "digits_elastic"
) -> dict[str, torch.Tensor]:
    """The final weights of ``+experiment=digits_elastic`` with ``trainer.exact=true`` run to
    its end at world 2 without chaos or resizes, in this process: what the same job -- resized 2 -> 1 -> 2,
    its workers or nodes killed -- must end with. ``overrides`` are the compared run's (epochs,
    seed...); the cluster's shape (``ray.*``) plays no part here."""
    job = compose_job(
        f"+experiment={experiment}",
        "trainer.exact=true",
        *overrides,
        "chaos=disabled",
        "chaos.at_steps=[]",
        "trainer.num_workers=2",
    )
    run = run_locally(job, run_dir)
    if run.summary["status"] != "succeeded":
        raise AssertionError(f"the reference run failed: {run.summary['error']}: {run.errors}")
    return final_weights(run.summary)
