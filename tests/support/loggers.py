"""What the experiment loggers wrote, read back with TensorBoard's, MLflow's and W&B's own
readers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def check_loggers(
    run_dir: Path,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    last_step: int,
    epochs: int,
    failures: int,
) -> None:
    """What the loggers wrote, read back with TensorBoard's, MLflow's and W&B's own readers:
    one point per logged step across the restores, params, and the failures as events."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = (run_dir / "logs" / "tensorboard" / name).glob("events.*")
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == last_step, steps
    assert [e.step for e in acc.Scalars("validation/accuracy")][-1] == last_step
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{run_dir / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name("ftjob").experiment_id])
    assert run.info.run_name == name and run.info.status == "FINISHED"
    assert run.data.params["trainer.epochs"] == str(epochs)
    history = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(history) == steps
    noticed = [v for k, v in run.data.tags.items() if k.startswith("event.") and "failure" in v]
    assert len(noticed) >= failures
    assert (run_dir / "logs" / "metrics.csv").stat().st_size > 0
    # Weights & Biases (offline), read back with wandb's own reader of its run log.
    records = wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    assert [h["trainer/step"] for h in history if "train/loss" in h] == steps  # once each
    assert any(h.get("events._type") == "table-file" for h in history)
    [started] = [r["run"] for r in records if r.get("type") == "run"]
    assert started["display_name"] == name
    assert wandb_config(records)["trainer.epochs"] == str(epochs)
    assert [r["exit"]["exit_code"] for r in records if r.get("type") == "exit"] == [0]


def wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of an offline W&B run under ``run_dir``, as ``wandb leet inspect`` reads
    its transaction log."""
    [log] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wandb_config(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's config as its records left it (the run's start, then each update)."""
    config: dict[str, Any] = {}
    for record in records:
        body = record.get("config") or (record.get("run") or {}).get("config") or {}
        config.update(body.get("update") or {})
    return config
