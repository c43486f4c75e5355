"""A run resumed by a new driver (a new Hydra run dir, a new run ledger) continues the same
W&B run and the same MLflow run -- their ids kept in the run's storage -- with one point per
step: the first driver logs only the steps its latest committed checkpoint settled, the second
the steps it trained from there."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from ftjob.config import LoggerConfig
from ftjob.driver.ledger import RunLedger
from ftjob.record import CheckpointRecord, Progress, RunPlan, RunStatus
from ftjob.reporting.loggers import LOGGER_RUNS_FILE, LogFeed, continued_loggers
from ftjob.reporting.run_summary import CheckpointsSection, RunSummary
from tests.support.loggers import wandb_records

PLAN = RunPlan(steps_per_epoch=40, epochs=1)
CHECKPOINT_20 = "file:///runs/run/step_000000020"


def driver(config: LoggerConfig, run_dir: Path, storage: Path, continues: bool) -> LogFeed:
    fs = fsspec.filesystem("file")
    feed = LogFeed(continued_loggers(config, str(run_dir), "run", (fs, str(storage)), continues))
    feed.params({"trainer": {"epochs": 1}})
    return feed


def train(ledger: RunLedger, attempt: int, step: int, loss: float) -> None:
    ledger.progress_update(attempt, Progress(step, 0, 1, 40, loss=loss, throughput=1.0, lr=0.1), {})


def two_drivers(config: LoggerConfig, tmp_path: Path) -> tuple[Path, Path]:
    """Driver 1 trains steps 10-30, commits step 20's checkpoint and is stopped (Ctrl-C);
    driver 2 resumes from step 20 and trains 30 and 40 (step 30 with another loss)."""
    storage = tmp_path / "storage" / "run"
    storage.mkdir(parents=True)
    first, second = tmp_path / "driver1", tmp_path / "driver2"
    feed = driver(config, first, storage, continues=False)
    ledger = RunLedger(PLAN)
    attempt = ledger.begin_attempt(0.0)
    for step in (10, 20, 30):
        train(ledger, attempt, step, loss=9.0 if step == 30 else 1.0 / step)
        if step == 20:
            ledger.checkpoint(attempt, CheckpointRecord(20, CHECKPOINT_20, None, 0.1))
    feed.records(ledger.log_feed(feed.cursor))
    feed.finish(
        RunSummary(
            status=RunStatus.interrupted, checkpoints=CheckpointsSection(latest=CHECKPOINT_20)
        )
    )
    assert (storage / LOGGER_RUNS_FILE).is_file()

    feed = driver(config, second, storage, continues=True)
    ledger = RunLedger(PLAN)  # a new driver's ledger
    attempt = ledger.begin_attempt(0.0)
    train(ledger, attempt, 30, loss=0.03)
    train(ledger, attempt, 40, loss=0.02)
    ledger.finish(1.0)
    feed.records(ledger.log_feed(feed.cursor))
    feed.finish(RunSummary(status=RunStatus.succeeded))
    return first, second


def test_a_resumed_run_continues_its_wandb_run_with_one_point_per_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = LoggerConfig(
        backends=["wandb"],
        wandb_group="resnet50-imagenet",
        wandb_tags=["ft", "8gpu"],
        wandb_notes="resume test",
        wandb_job_type="train",
        wandb_system_stats=False,  # the driver's CPU figures: noise in a test
    )
    runs = [wandb_records(run_dir) for run_dir in two_drivers(config, tmp_path)]
    [[started], [resumed]] = [[r["run"] for r in rs if r.get("type") == "run"] for rs in runs]
    assert started["run_id"] == resumed["run_id"]  # one W&B run: `wandb sync` joins them
    assert resumed["run_group"] == "resnet50-imagenet" and resumed["tags"] == ["ft", "8gpu"]
    assert resumed["notes"] == "resume test" and resumed["job_type"] == "train"
    points = [
        (h["trainer/step"], h["train/loss"])
        for rs in runs
        for h in (r["history"]["item"] for r in rs if r.get("type") == "history")
        if "train/loss" in h
    ]
    assert points == [(10, 0.1), (20, 0.05), (30, 0.03), (40, 0.02)]  # not step 30's 9.0


def test_a_resumed_run_continues_its_mlflow_run_by_id(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"  # a tracking store both drivers reach
    two_drivers(LoggerConfig(backends=["mlflow"], mlflow_tracking_uri=uri), tmp_path)
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("ftjob").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [
        (10, 0.1),
        (20, 0.05),
        (30, pytest.approx(0.03)),
        (40, 0.02),
    ]
    assert run.info.status == "FINISHED" and run.data.params["trainer.epochs"] == "1"
