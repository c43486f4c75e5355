"""The run's outputs mirrored into its storage (loopback S3), only what changed, secrets kept
out, and read back by ``python -m ftjob.report`` from the bucket; a mirror that cannot write
is said, never raised."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem
from omegaconf import OmegaConf

from ftjob.cli.report import earlier_copies, logger_hints
from ftjob.cli.report import main as report
from ftjob.config import LoggerConfig, RetryConfig
from ftjob.config.secrets import Redactor
from ftjob.driver.ledger import RunLedger
from ftjob.record import CheckpointRecord, Progress, RunPlan, RunStatus
from ftjob.reporting.loggers import LogFeed, build_loggers
from ftjob.reporting.outputs import OUTPUTS_DIR, OutputsMirror, fetch_outputs, tee_console
from ftjob.reporting.run_summary import RunSummary
from ftjob.reporting.summary import build_summary, write_summary
from ftjob.reporting.sweep import mirror_sweep_report
from ftjob.storage.fs import build_filesystem
from ftjob.storage.lease import RunLease
from tests.support.s3 import FAST_RETRY, fresh_s3fs, s3_keys  # noqa: F401 -- fresh_s3fs: autouse

pytestmark = pytest.mark.s3
SECRET = "hunter2-very-secret"


def a_run_dir(run_dir: Path, draw: bool = True) -> RunSummary:
    """A run dir as the driver leaves it: .hydra/, summary.json, timeline.png, console.log."""
    ledger = RunLedger(RunPlan(steps_per_epoch=20, epochs=1))
    attempt = ledger.begin_attempt(0.0)
    for step in (10, 20):
        ledger.progress_update(
            attempt, Progress(step, 0, 1, 20, loss=0.5, throughput=9.0, lr=0.01), {}
        )
    ledger.checkpoint(attempt, CheckpointRecord(20, "s3://b/run/step_000000020", None, 0.1))
    ledger.finish(5.0)
    summary = build_summary(
        ledger.snapshot(),
        name="run",
        status=RunStatus.succeeded,
        error=None,
        wall_time_s=6.0,
        config={"trainer": {"epochs": 1}},
    )
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(f"- trainer.epochs=1\n- key={SECRET}\n")
    write_summary(summary, str(run_dir))
    if draw:  # its bytes are copied as they are; the report draws it again from the summary
        (run_dir / "timeline.png").write_bytes(b"\x89PNG\r\n\x1a\n the picture")
    return summary


def test_outputs_are_mirrored_to_s3_only_what_changed_and_read_back_by_report(
    s3_endpoint, s3_bucket, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # what the report's reader uses too
    run_dir = tmp_path / "run_dir"
    summary = a_run_dir(run_dir)
    echo = tee_console(str(run_dir), lambda line: None)
    echo("00:01 epoch 1/1 step 10/20")
    fs, target = build_filesystem(f"s3://{s3_bucket}/runs/run/{OUTPUTS_DIR}", {}, FAST_RETRY)
    redactor = Redactor()
    redactor.add(SECRET)  # e.g. a storage key given on the command line
    mirror = OutputsMirror(fs, target, str(run_dir), redactor).start()
    mirror.request()
    echo("00:02 checkpoint step 20 committed (0.10s)")
    assert mirror.close() is None
    keys = s3_keys(s3_endpoint, s3_bucket)
    assert sorted(keys) == [
        f"runs/run/outputs/{name}"
        for name in (".hydra/overrides.yaml", "console.log", "summary.json", "timeline.png")
    ]
    assert mirror.sync() == 0  # nothing changed: nothing sent again
    echo("summary: done")
    assert mirror.sync() == 1  # the console log only
    mirrored = {k: fs.cat_file(f"{s3_bucket}/{k}") for k in keys}
    assert SECRET not in mirrored["runs/run/outputs/.hydra/overrides.yaml"].decode()
    assert b"summary: done" in fs.cat_file(f"{target}/console.log")
    assert json.loads(mirrored["runs/run/outputs/summary.json"]) == summary.document()

    # The driver's machine is gone: the report reads the run from its storage.
    capsys.readouterr()
    assert report([f"s3://{s3_bucket}/runs/run"]) == 0
    printed = capsys.readouterr().out
    assert f"outputs of s3://{s3_bucket}/runs/run/outputs, copied to" in printed
    local = printed.split("copied to ")[1].split()[0]
    assert "succeeded" in printed and os.path.isfile(os.path.join(local, "timeline.png"))
    assert report([f"s3://{s3_bucket}/runs/nothing-here"]) == 2


def test_a_mirror_that_cannot_write_is_said_and_leaves_the_run_dir_alone(
    s3_endpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    run_dir = tmp_path / "run_dir"
    a_run_dir(run_dir, draw=False)
    retry = RetryConfig(max_attempts=2, initial_backoff=0.01, max_backoff=0.01, deadline=5.0)
    fs, target = build_filesystem("s3://ftjob-no-such-bucket/runs/run/outputs", {}, retry)
    mirror = OutputsMirror(fs, target, str(run_dir), Redactor())
    assert mirror.sync() == 0
    warning = mirror.close()
    assert warning is not None
    assert "2 output file(s) could not be copied to s3://ftjob-no-such-bucket/runs/run/outputs" in (
        warning
    )
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "succeeded"


def test_a_sweeps_report_is_copied_to_its_storage_and_read_back(
    s3_endpoint, s3_bucket, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    sweep_dir = tmp_path / "multirun" / "2026-12-04" / "09-10-00"
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "sweep_summary.md").write_text("| job | status |\n|---|---|\n| 0 | succeeded |\n")
    (sweep_dir / "multirun.yaml").write_text(f"key: {SECRET}\n")
    (sweep_dir / "0").mkdir()  # a job's dir: its outputs go with its own run
    (sweep_dir / "0" / "summary.json").write_text("{}")
    storage = {
        "storage_path": f"s3://{s3_bucket}/runs",
        "storage_options": {"key": "AKIAIOSFODNN7EXAMPLE", "secret": SECRET},
    }
    config = OmegaConf.create({"checkpoint": storage})
    said = mirror_sweep_report(config, str(sweep_dir))
    assert said == f"sweep report copied to s3://{s3_bucket}/runs/sweeps/2026-12-04_09-10-00"
    prefix = "runs/sweeps/2026-12-04_09-10-00/"
    keys = s3_keys(s3_endpoint, s3_bucket)
    assert keys == [prefix + "multirun.yaml", prefix + "sweep_summary.md"]
    fs, _ = build_filesystem(f"s3://{s3_bucket}", {}, FAST_RETRY)
    assert SECRET not in fs.cat_file(f"{s3_bucket}/{prefix}multirun.yaml").decode()
    capsys.readouterr()
    assert report([f"s3://{s3_bucket}/{prefix}"]) == 0
    assert "| 0 | succeeded |" in capsys.readouterr().out
    assert mirror_sweep_report(OmegaConf.create({"checkpoint": {}}), str(sweep_dir)) is None


def test_the_console_log_is_not_written_twice_when_stdout_already_goes_there(tmp_path, monkeypatch):
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)

    with open(tmp_path / "console.log", "a") as console:  # a sweep job's stdout (the launcher)
        monkeypatch.setattr(sys, "stdout", console)
        assert tee_console(str(tmp_path), say) is say
    monkeypatch.undo()
    tee_console(str(tmp_path), say)("a line")
    assert said == ["a line"] and (tmp_path / "console.log").read_text() == "a line\n"


def test_the_loggers_files_are_mirrored_and_read_back_by_their_own_readers(
    s3_endpoint, s3_bucket, tmp_path, monkeypatch, capsys
):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "run_dir"
    a_run_dir(run_dir, draw=False)
    config = LoggerConfig(backends=["csv", "tensorboard", "mlflow"])
    feed = LogFeed(build_loggers(config, str(run_dir), "run"))  # logs/ and mlruns/ of run_dir
    feed.params({"trainer": {"epochs": 1}})
    ledger = RunLedger(RunPlan(steps_per_epoch=20, epochs=1))
    attempt = ledger.begin_attempt(0.0)
    for step in (10, 20):
        ledger.progress_update(attempt, Progress(step, 0, 1, 20, 1.0 / step, 9.0, 0.01), {})
    ledger.finish(3.0)
    feed.records(ledger.log_feed(feed.cursor))
    feed.finish(RunSummary(status=RunStatus.succeeded))
    (run_dir / "mlruns" / ".trash").mkdir(exist_ok=True)
    (run_dir / "mlruns" / ".trash" / "gone").write_text("deleted runs stay")
    (run_dir / "logs" / "blob").write_bytes(b"\xff\xfe" + SECRET.encode() + b"\x00")
    offline = run_dir / "wandb" / "offline-run-20261204_131500-abc123" / "files"
    offline.mkdir(parents=True)  # a W&B offline run: copied for `wandb sync`; W&B's logs not
    (offline / "config.yaml").write_text(f"key: {SECRET}\n")
    (run_dir / "wandb" / "debug.log").write_text("W&B's own log")
    (run_dir / "logs" / "elsewhere").symlink_to(tmp_path)  # never followed
    storage = tmp_path / "storage"  # the run's storage (S3 above: the same mirror)
    fs, target = build_filesystem(str(storage / "run" / OUTPUTS_DIR), {}, FAST_RETRY)
    redactor = Redactor()
    redactor.add(SECRET)
    assert OutputsMirror(fs, target, str(run_dir), redactor).close() == (
        f"1 symbolic link(s) in the run dir left out of the copy in {fs.unstrip_protocol(target)} "
        "(logs/elsewhere): a link is never followed out of the run dir"
    )
    keys = sorted(str(p.relative_to(storage)) for p in storage.rglob("*") if p.is_file())
    assert "run/outputs/logs/metrics.csv" in keys
    assert any(k.startswith("run/outputs/logs/tensorboard/run/events.") for k in keys)
    assert any(k.endswith("/metrics/train/loss") for k in keys), keys  # MLflow's, 6 deep
    assert f"run/outputs/{offline.relative_to(run_dir)}/config.yaml" in keys
    assert not [k for k in keys if ".trash" in k or "debug.log" in k or "elsewhere" in k]
    stored = [(storage / k).read_bytes() for k in keys]
    assert not any(SECRET.encode() in blob for blob in stored)

    # Read back as the report reads a run from storage, then by TensorBoard's and MLflow's own
    # readers, as the hints the report prints open them.
    local = tmp_path / "fetched"
    fetch_outputs(fs, target, str(local))
    assert logger_hints(str(local)) == [
        f"TensorBoard: tensorboard --logdir {local / 'logs'}",
        f"MLflow: mlflow ui --backend-store-uri {local / 'mlruns'}",
        f"W&B (offline run): wandb sync {local / 'wandb' / offline.parent.name}",
    ]
    [events] = (local / "logs" / "tensorboard" / "run").glob("events.*")
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    assert [s.step for s in acc.Scalars("train/loss")] == [10, 20]
    client = MlflowClient(tracking_uri=f"file:{local / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name("ftjob").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [10, 20] and run.info.status == "FINISHED"


def test_a_continued_runs_driver_keeps_the_earlier_drivers_copy_aside(tmp_path):
    # Driver 1 died of a bug; a scheduler's rerun continues the run in a run dir of its own,
    # then a third driver: each earlier copy is kept under earlier/N/, never overwritten.
    storage = tmp_path / "storage" / "run" / OUTPUTS_DIR
    fs, target = build_filesystem(str(storage), {}, FAST_RETRY)
    for driver in (1, 2, 3):
        run_dir = tmp_path / f"driver{driver}"
        run_dir.mkdir()
        (run_dir / "console.log").write_text(f"driver {driver}\n")
        if driver == 1:
            (run_dir / "traceback.txt").write_text("Traceback (most recent call last): ...\n")
        mirror = OutputsMirror(fs, target, str(run_dir), Redactor())
        assert mirror.close() is None
        if driver > 1:
            assert mirror.kept_earlier == f"file://{storage}/earlier/{driver - 1}"
    assert (storage / "console.log").read_text() == "driver 3\n"
    assert not (storage / "traceback.txt").exists()  # driver 1's: not beside driver 3's record
    assert (storage / "earlier" / "1" / "traceback.txt").is_file()
    assert [(storage / "earlier" / n / "console.log").read_text() for n in ("1", "2")] == [
        "driver 1\n",
        "driver 2\n",
    ]
    local = tmp_path / "fetched"
    fetched = fetch_outputs(fs, target, str(local))
    assert "earlier/1/traceback.txt" in fetched and "earlier/2/console.log" in fetched
    assert earlier_copies(str(local)) == [
        f"earlier drivers' outputs: {local / 'earlier' / '1'}, {local / 'earlier' / '2'}"
    ]


def test_links_in_the_run_dir_are_never_followed_out_of_it_and_said_once(tmp_path):
    # hydra.run.dir=. makes a working directory the run dir: whatever its *.log and .hydra/
    # entries link to must stay where it is.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "private.txt").write_text("outside the run dir: id_rsa contents\n")
    (outside / "hydra").mkdir()
    (outside / "hydra" / "config.yaml").write_text("elsewhere: true\n")
    run_dir = tmp_path / "run_dir"
    a_run_dir(run_dir, draw=False)
    (run_dir / "console.log").write_text("run\n")
    (run_dir / "notes.log").symlink_to(outside / "private.txt")
    (run_dir / ".hydra" / "host.yaml").symlink_to(outside / "private.txt")
    (run_dir / "mlruns").symlink_to(outside / "hydra")  # a logger's whole tree
    storage = tmp_path / "storage"
    fs, target = build_filesystem(str(storage / "run" / OUTPUTS_DIR), {}, FAST_RETRY)
    mirror = OutputsMirror(fs, target, str(run_dir), Redactor())
    assert mirror.sync() == 3 and mirror.sync() == 0  # summary, console log, overrides
    out = storage / "run" / OUTPUTS_DIR
    copied = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert copied == [".hydra/overrides.yaml", "console.log", "summary.json"]
    # Said once, at the end, with what was left out.
    assert mirror.close() == (
        f"3 symbolic link(s) in the run dir left out of the copy in {mirror.url} (.hydra/host.yaml, "
        "mlruns, notes.log): a link is never followed out of the run dir"
    )
    # A file made a link after it was listed is refused at its opening, not followed.
    (run_dir / "console.log").unlink()
    (run_dir / "console.log").symlink_to(outside / "private.txt")
    with pytest.raises(OSError):
        mirror._copy("console.log", str(run_dir / "console.log"))


def leased_run(tmp_path: Path) -> tuple[Path, Any, str, RunLease, Path]:
    """A run in local storage whose lease a first driver holds: (the run's directory, the
    outputs' filesystem and folder, the first driver's lease, its run dir)."""
    run = tmp_path / "storage" / "run"
    fs, target = build_filesystem(str(run / OUTPUTS_DIR), {}, FAST_RETRY)
    first = RunLease(LocalFileSystem(), str(run), 60.0, owner="first:1")
    first.acquire()
    run_dir = tmp_path / "zombie"
    run_dir.mkdir()
    return run, fs, target, first, run_dir


def taken_over(first: RunLease, run: Path) -> None:
    """The run taken over by a second driver, as after the first one's timeout."""
    first.release()
    RunLease(LocalFileSystem(), str(run), 60.0, owner="second:2").acquire()


def test_a_deposed_drivers_mirror_copies_nothing_over_the_live_drivers_outputs(tmp_path):
    """A driver frozen past its lease and thawed after another took the run over: its mirror
    checks the lease before every copy, and copies nothing once the run is another's."""
    run, fs, target, first, zombie_dir = leased_run(tmp_path)
    (zombie_dir / "console.log").write_text("the first driver\n")
    mirror = OutputsMirror(fs, target, str(zombie_dir), Redactor(), first.fence())
    assert mirror.sync() == 1
    taken_over(first, run)
    (run / OUTPUTS_DIR / "console.log").write_text("the live driver\n")
    (zombie_dir / "console.log").write_text("the first driver, thawed\n")
    assert mirror.sync() == 0
    assert mirror.deposed is not None and "second:2" in mirror.deposed
    assert mirror.close() == f"outputs: nothing more copied to {mirror.url}: {mirror.deposed}"
    assert (run / OUTPUTS_DIR / "console.log").read_text() == "the live driver\n"


def test_a_takeover_during_a_sync_stops_it_before_the_next_file(tmp_path):
    run, fs, target, first, run_dir = leased_run(tmp_path)
    for name in ("console.log", "summary.json"):
        (run_dir / name).write_text(name)
    checks: list[int] = []

    def fence() -> None:
        checks.append(1)
        if len(checks) == 3:  # the sync's own check, the first file's: then the takeover
            taken_over(first, run)
        first.fence()()

    mirror = OutputsMirror(fs, target, str(run_dir), Redactor(), fence)
    assert mirror.sync() == 1 and len(checks) == 3
    assert len(list((run / OUTPUTS_DIR).iterdir())) == 1  # one of the two: the first listed
    assert mirror.deposed is not None and "second:2" in mirror.deposed
