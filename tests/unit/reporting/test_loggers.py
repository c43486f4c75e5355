"""Experiment loggers: each step logged once, in its surviving version, read back with the
libraries' own readers (TensorBoard's event accumulator, MLflow's client on a file store,
``wandb leet inspect`` on an offline W&B run)."""

from __future__ import annotations

import csv
import glob
import math
import re

import pytest

from ftjob.config import ConfigError, LoggerConfig
from ftjob.driver.ledger import RunLedger
from ftjob.record import (
    CheckpointRecord,
    Progress,
    RunPlan,
    RunStatus,
    StepRecord,
    ValidationResult,
)
from ftjob.reporting.loggers import LogFeed, build_loggers, flatten
from ftjob.reporting.run_summary import RunSummary
from tests.support.loggers import wandb_config, wandb_records


def train(ledger: RunLedger, attempt: int, step: int, loss: float) -> None:
    progress = Progress(step, 0, 1, 40, loss=loss, throughput=100.0, lr=0.01)
    ledger.progress_update(attempt, progress, {})


def run_with_a_restore(feed: LogFeed) -> RunLedger:
    """Steps 10-30 trained; the checkpoint of step 20 commits; the attempt dies after 30; the
    next one restores step 20 and trains 30 and 40 again with other losses."""
    ledger = RunLedger(RunPlan(steps_per_epoch=40, epochs=1))
    a0 = ledger.begin_attempt(0.0)
    for step in (10, 20):
        train(ledger, a0, step, loss=1.0 / step)
    ledger.validation(a0, 20, ValidationResult(0, loss=0.5, accuracy=0.8, samples=10, time=1.0))
    ledger.checkpoint(a0, CheckpointRecord(20, "ckpt/20", None, 0.1))
    train(ledger, a0, 30, loss=9.0)  # lost with the attempt
    feed.records(ledger.log_feed(feed.cursor))
    feed.events(["failure noticed (1 worker(s)): boom"], 5.0)
    a1 = ledger.begin_attempt(6.0)
    train(ledger, a1, 30, loss=0.03)
    train(ledger, a1, 40, loss=0.02)
    ledger.finish(9.0)
    feed.records(ledger.log_feed(feed.cursor))
    return ledger


def test_a_step_trained_again_after_a_restore_is_logged_once_in_its_surviving_version(tmp_path):
    feed = LogFeed(build_loggers(LoggerConfig(backends=["csv"]), str(tmp_path), "run"))
    feed.params({"trainer": {"lr": 0.01, "epochs": 1}})
    run_with_a_restore(feed)
    feed.finish(RunSummary(status=RunStatus.succeeded))
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["name"] == "train/loss"]
    assert [(int(r["step"]), float(r["value"])) for r in rows] == [
        (10, 0.1),
        (20, 0.05),
        (30, 0.03),  # not 9.0: the lost attempt's step 30 never reached a logger
        (40, 0.02),
    ]
    with open(tmp_path / "logs" / "events.csv") as f:
        assert "failure noticed" in f.read()


def test_wandb_offline_run_holds_one_point_per_step_the_config_events_and_the_outcome(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: what `wandb sync` uploads later
    config = LoggerConfig(backends=["wandb"])
    feed = LogFeed(build_loggers(config, str(tmp_path), "run"))
    feed.params({"trainer": {"lr": 0.01, "epochs": 1}})
    run_with_a_restore(feed)
    feed.finish(RunSummary(status=RunStatus.succeeded, metrics={"goodput/ettr": 0.5}))
    records = wandb_records(tmp_path)  # wandb's own reader of its run log
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    losses = [(h["trainer/step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert losses == [(10, 0.1), (20, 0.05), (30, 0.03), (40, 0.02)]  # not step 30's 9.0
    assert any(h.get("events._type") == "table-file" for h in history)
    summary = {
        k: v
        for r in records
        if r.get("type") == "summary"
        for k, v in r["summary"]["update"].items()
    }
    assert summary["status"] == "succeeded" and summary["summary/goodput/ettr"] == 0.5
    assert [r["exit"]["exit_code"] for r in records if r.get("type") == "exit"] == [0]
    assert wandb_config(records)["trainer.epochs"] == "1"  # the params, flat
    # Its id, kept with the run for its resumes: 64 random bits, never another run's.
    assert re.fullmatch(r"[0-9a-f]{16}", feed.loggers[0].run_ids["wandb_id"])


def test_a_wandb_mode_that_does_not_exist_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="logger.wandb_mode"):
        LoggerConfig(wandb_mode="sometimes")


def test_tensorboard_event_files_hold_one_point_per_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    feed = LogFeed(build_loggers(LoggerConfig(backends=["tensorboard"]), str(tmp_path), "run"))
    feed.params({"trainer": {"lr": 0.01}})
    run_with_a_restore(feed)
    feed.finish(RunSummary(status=RunStatus.succeeded, metrics={"goodput/ettr": 0.5}))
    [events] = glob.glob(str(tmp_path / "logs" / "tensorboard" / "run" / "events.*"))
    acc = EventAccumulator(events, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [s.step for s in loss] == [10, 20, 30, 40]
    assert loss[2].value == pytest.approx(0.03)
    assert [s.step for s in acc.Scalars("validation/accuracy")] == [20]
    assert "events/text_summary" in acc.Tags()["tensors"]


def test_mlflow_file_store_holds_params_metrics_once_and_events(tmp_path):
    from mlflow.tracking import MlflowClient

    config = LoggerConfig(backends=["mlflow"], mlflow_experiment="tests")
    feed = LogFeed(build_loggers(config, str(tmp_path), "run"))
    feed.params({"trainer": {"lr": 0.01}, "chaos": {"fail_at_steps": [30]}})
    run_with_a_restore(feed)
    feed.finish(RunSummary(status=RunStatus.succeeded))
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.data.params["trainer.lr"] == "0.01"
    assert run.data.params["chaos.fail_at_steps"] == "[30]"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [10, 20, 30, 40]
    assert any("failure noticed" in v for k, v in run.data.tags.items() if k.startswith("event."))
    assert run.info.status == "FINISHED"


def test_a_failing_logger_is_dropped_and_said_not_the_run(tmp_path, caplog):
    class Broken:
        def scalars(self, step: int, values: dict) -> None:
            raise OSError("disk full")

    feed = LogFeed([Broken()])
    feed._flush(math.inf)
    feed.pending[(1, "train")] = StepRecord("train", attempt=0, step=1, values={"x": 1.0})
    feed._flush(math.inf)
    assert feed.loggers == [] and "disk full" in caplog.text


def test_params_are_flat_and_a_missing_backend_names_its_extra(monkeypatch):
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {
        "a.b": "1",
        "a.c": "[1, 2]",
        "d": "None",
    }
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name)
    )
    with pytest.raises(ConfigError, match=r"pip install 'ftjob\[mlflow\]'"):
        LoggerConfig(backends=["mlflow"])
    with pytest.raises(ConfigError, match="logger.backends"):
        LoggerConfig(backends=["neptune"])  # not a backend ftjob has


def test_live_points_are_logged_at_once_and_tensorboard_rewinds_what_a_restore_made_stale(
    tmp_path,
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = LoggerConfig(backends=["csv", "tensorboard"], live=True)
    feed = LogFeed(build_loggers(config, str(tmp_path), "run"), live=config.live)

    def csv_losses() -> list[tuple[int, float]]:
        with open(tmp_path / "logs" / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["name"] == "train/loss"]
        return [(int(r["step"]), float(r["value"])) for r in rows]

    ledger = RunLedger(RunPlan(steps_per_epoch=40, epochs=1))
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, 10, loss=0.1)
    ledger.checkpoint(a0, CheckpointRecord(10, "ckpt/10", None, 0.1))
    train(ledger, a0, 20, loss=9.0)
    feed.records(ledger.log_feed(feed.cursor))
    assert csv_losses() == [(10, 0.1), (20, 9.0)]  # at once: step 20 is past the checkpoint
    feed.events(["failure noticed (1 worker(s)): boom"], 5.0)
    train(ledger, a0, 30, loss=9.0)  # the dying attempt's last step, seen with the next's
    a1 = ledger.begin_attempt(6.0)  # restored step 10
    train(ledger, a1, 20, loss=0.02)
    train(ledger, a1, 30, loss=0.03)
    feed.records(ledger.log_feed(feed.cursor))
    feed.finish(RunSummary(status=RunStatus.succeeded))
    # CSV keeps what was logged: step 20 twice; the stale step 30 never reached a logger.
    assert csv_losses() == [(10, 0.1), (20, 9.0), (20, 0.02), (30, 0.03)]
    [events] = glob.glob(str(tmp_path / "logs" / "tensorboard" / "run" / "events.*"))
    acc = EventAccumulator(events, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [s.step for s in loss] == [10, 20, 30]  # rewound at step 20: each step once
    assert [round(s.value, 3) for s in loss] == [0.1, 0.02, 0.03]
    assert [e.step for e in acc.Tensors("events/text_summary")] == [20]  # the failure stays


def test_two_runs_of_one_name_in_a_shared_logger_dir_keep_their_own_files(tmp_path):
    """Runs share a logger.dir (a sweep's, a team's): each run's CSV and TensorBoard files lie
    in a folder of its identity, so a second run called `exp` (other storage) neither
    overwrites the first one's CSV nor mixes into -- or rewinds -- its TensorBoard run."""
    shared = tmp_path / "shared-logs"
    config = LoggerConfig(backends=["csv", "tensorboard"], dir=str(shared))
    for label, loss in (("exp@" + "a" * 16, 0.5), ("exp@" + "b" * 16, 0.25)):
        for logger in build_loggers(config, str(tmp_path / label), "exp", label=label):
            logger.scalars(10, {"train/loss": loss})
            logger.finish(RunSummary(status=RunStatus.succeeded))
    for label, loss in (("exp@" + "a" * 16, 0.5), ("exp@" + "b" * 16, 0.25)):
        with open(shared / label / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["name"] == "train/loss"]
        assert [float(r["value"]) for r in rows] == [loss]
        assert any((shared / "tensorboard" / label).iterdir())
    assert not (shared / "metrics.csv").exists() and not (shared / "tensorboard" / "exp").exists()
