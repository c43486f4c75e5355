"""Run names and resumption: a new run never silently continues an old one, and a resumed run
refuses config changes its checkpoint cannot follow."""

from __future__ import annotations

import json
from typing import Any

from ftjob.checkpoint import CheckpointStore, CorruptCheckpoint
from ftjob.config import JobConfig, to_plain


class ResumeError(RuntimeError):
    """The run to resume is missing, or the config changed incompatibly."""


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _fingerprint(config: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint depends on: the model, the dataset's kind, the data order."""
    t = config["trainer"]
    return {
        **_flatten(config["model"], "model"),
        "dataset._target_": config["dataset"].get("_target_"),
        "dataset.num_classes": config["dataset"].get("num_classes"),
        "trainer.batch_size x trainer.num_workers (global batch)": t["batch_size"]
        * t["num_workers"],
        "trainer.seed (data order)": t["seed"],
    }


def breaking_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Lines ``key: saved -> current`` for every difference that breaks the checkpoint."""
    old, new = _fingerprint(saved), _fingerprint(current)
    return [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


def latest_config(store: CheckpointStore) -> dict[str, Any] | None:
    """The config saved in the newest committed checkpoint."""
    for step in store.steps():
        try:
            store.read_manifest(step)
            return json.loads(store.read_file(step, "config.json"))
        except (CorruptCheckpoint, FileNotFoundError, ValueError):
            continue
    return None


def check_resume(job: JobConfig, store: CheckpointStore, url: str) -> None:
    steps = store.steps()
    if not job.resume:
        if steps:
            raise ResumeError(
                f"name={job.name!r}: a run with this name already has checkpoints at {url}; "
                "pass resume=true to continue it, or choose another name"
            )
        return
    saved = latest_config(store) if steps else None
    if saved is None:
        raise ResumeError(
            f"resume=true: no committed checkpoint of run {job.name!r} at {url}; check name= and "
            "checkpoint.storage_path= (the storage of the run to continue)"
        )
    changes = breaking_changes(saved, to_plain(job))
    if changes:
        raise ResumeError(
            f"resume=true: run {job.name!r} cannot continue with this config; its checkpoint needs:\n  "
            + "\n  ".join(changes)
            + "\nrevert these overrides, or start a new run (drop resume=true)"
        )
