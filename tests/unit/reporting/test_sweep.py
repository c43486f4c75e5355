"""Sweep reports: tables and plots from job dirs (unit, no Ray), and real ``-m`` sweeps (ray)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from ftjob import metrics as M
from ftjob.cli.report import main
from ftjob.reporting.sweep import (
    INCOMPLETE,
    SWEEP_CSV,
    SWEEP_MD,
    SWEEP_PNG,
    SweepReportCallback,
    build_sweep_report,
    declared_sweep_keys,
)
from tests.support.sweeps import CHEAP_JOB, PNG_MAGIC, read_csv


def write_job(
    sweep_dir: Path, job: str, overrides: list[str], summary: dict[str, Any] | None
) -> Path:
    """A job dir as Hydra and ftjob leave it: .hydra/overrides.yaml, and summary.json once
    the job ended."""
    job_dir = sweep_dir / job
    (job_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job_dir / ".hydra" / "overrides.yaml")
    if summary is not None:
        (job_dir / "summary.json").write_text(json.dumps(summary))
    return job_dir


def summary(
    status: str = "succeeded", error: str | None = None, wall: float = 30.0, **metrics: float
) -> dict[str, Any]:
    values = dict.fromkeys(M.METRIC_KEYS, 0.0)
    values.update({key.replace("__", "/"): v for key, v in metrics.items()})
    return {
        "name": f"run-{wall}",
        "status": status,
        "error": error,
        "wall_time_s": wall,
        "metrics": values,
    }


@pytest.fixture
def sweep_2x2(tmp_path: Path) -> Path:
    """Four jobs over chaos.interval x checkpoint.retry.max_attempts: two succeeded, one
    failed, one never wrote summary.json (killed or still running)."""
    common = ["+experiment=digits_ft", "trainer.epochs=1"]
    write_job(
        tmp_path,
        "0",
        [*common, "chaos.interval=5", "checkpoint.retry.max_attempts=1"],
        summary(
            wall=41.5,
            failures__count=2,
            chaos__kills=2,
            recovery__time_to_recover=7.25,
            recovery__lost_steps=6,
            checkpoint__upload_retries=3,
            checkpoint__upload_failures=1,
            validation__accuracy=0.91,
            train__global_throughput=512.0,
        ),
    )
    write_job(
        tmp_path,
        "1",
        [*common, "chaos.interval=5", "checkpoint.retry.max_attempts=3"],
        summary(status="failed", error="StorageError: bucket gone\ntraceback line", wall=3.0),
    )
    write_job(
        tmp_path, "2", [*common, "chaos.interval=10", "checkpoint.retry.max_attempts=1"], None
    )
    # Hydra numbers jobs 0, 1, ..., 10: "10" must sort after "2".
    write_job(
        tmp_path,
        "10",
        [*common, "chaos.interval=10", "checkpoint.retry.max_attempts=3"],
        summary(wall=35.0, validation__accuracy=0.93),
    )
    return tmp_path


def test_csv_has_one_row_per_job_with_swept_values_and_outcomes(sweep_2x2: Path) -> None:
    paths = build_sweep_report(str(sweep_2x2))

    rows = read_csv(Path(paths.csv))
    assert [r["job"] for r in rows] == ["0", "1", "2", "10"]
    columns = list(rows[0])
    # Only the keys that vary are columns; the common overrides are not.
    assert columns[1:3] == ["chaos.interval", "checkpoint.retry.max_attempts"]
    assert "experiment" not in columns and "trainer.epochs" not in columns
    assert [(r["chaos.interval"], r["checkpoint.retry.max_attempts"]) for r in rows] == [
        ("5", "1"),
        ("5", "3"),
        ("10", "1"),
        ("10", "3"),
    ]
    first = rows[0]
    assert first["status"] == "succeeded"
    assert float(first["wall_time_s"]) == 41.5
    assert first[M.FAILURES_COUNT] == "2" and first[M.CHAOS_KILLS] == "2"
    assert float(first[M.RECOVERY_TIME_TO_RECOVER]) == 7.25
    assert first[M.RECOVERY_LOST_STEPS] == "6"
    assert first[M.CHECKPOINT_UPLOAD_RETRIES] == "3"
    assert first[M.CHECKPOINT_UPLOAD_FAILURES] == "1"
    assert float(first[M.VALIDATION_ACCURACY]) == 0.91
    assert float(first[M.TRAIN_GLOBAL_THROUGHPUT]) == 512.0


def test_failed_and_incomplete_jobs_are_rows_marked_as_such(sweep_2x2: Path) -> None:
    paths = build_sweep_report(str(sweep_2x2))

    rows = {r["job"]: r for r in read_csv(Path(paths.csv))}
    assert rows["1"]["status"] == "failed"
    assert rows["1"]["error"] == "StorageError: bucket gone"  # the first line only
    assert rows["2"]["status"] == INCOMPLETE
    assert rows["2"][M.VALIDATION_ACCURACY] == ""  # unknown, not 0
    markdown = Path(paths.markdown).read_text()
    assert "2 succeeded" in markdown and "1 failed" in markdown and "1 incomplete" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 4  # header + one row per job
    assert "| 1 | 5 | 3 | failed |" in markdown
    assert "StorageError: bucket gone" in markdown


def test_plot_is_written_as_png(sweep_2x2: Path) -> None:
    paths = build_sweep_report(str(sweep_2x2))

    assert Path(paths.plot).name == SWEEP_PNG
    assert Path(paths.plot).read_bytes()[:8] == PNG_MAGIC
    assert f"]({SWEEP_PNG})" in Path(paths.markdown).read_text()


def test_goodput_of_each_job_is_a_stacked_bar(tmp_path: Path) -> None:
    buckets = {"startup": 10.0, "training": 20.0, "restart": 5.0, "other": 1.0}
    for job, interval in (("0", 5), ("1", 10)):
        s = summary(wall=36.0, goodput__ettr=20 / 36)
        s["goodput"] = {"wall_s": 36.0, "ettr": 20 / 36, "buckets": buckets}
        write_job(tmp_path, job, [f"chaos.interval={interval}"], s)
    write_job(tmp_path, "2", ["chaos.interval=20"], summary(wall=3.0))  # an older summary
    paths = build_sweep_report(str(tmp_path))
    assert Path(paths.goodput).read_bytes()[:8] == PNG_MAGIC
    assert "](sweep_goodput.png)" in Path(paths.markdown).read_text()
    rows = {r["job"]: r for r in read_csv(Path(paths.csv))}
    assert rows["0"]["goodput/ettr"] == "0.555556" and rows["2"]["goodput/ettr"] == "0"


def test_categorical_and_single_key_sweeps_plot(tmp_path: Path) -> None:
    for i, path in enumerate(["s3://a/x", "null", "/tmp/ckpt"]):
        write_job(tmp_path, str(i), [f"checkpoint.storage_path={path}"], summary(wall=10.0 + i))

    paths = build_sweep_report(str(tmp_path))

    assert Path(paths.plot).read_bytes()[:8] == PNG_MAGIC
    assert [r["checkpoint.storage_path"] for r in read_csv(Path(paths.csv))] == [
        "s3://a/x",
        "null",
        "/tmp/ckpt",
    ]


def write_multirun_yaml(sweep_dir: Path, task: list[str], params: dict[str, str]) -> None:
    cfg = {"hydra": {"overrides": {"task": task}, "sweeper": {"params": params}}}
    OmegaConf.save(OmegaConf.create(cfg), sweep_dir / "multirun.yaml")


def test_swept_keys_are_known_from_multirun_yaml_before_they_vary(tmp_path: Path) -> None:
    # A sweep killed after its first job: nothing varies yet, but the columns are known.
    write_multirun_yaml(
        tmp_path, ["+experiment=digits_ft", "chaos.interval=5,10"], {"trainer.seed": "0,1"}
    )
    write_job(
        tmp_path, "0", ["trainer.seed=0", "+experiment=digits_ft", "chaos.interval=5"], summary()
    )

    paths = build_sweep_report(str(tmp_path))

    assert list(read_csv(Path(paths.csv))[0])[1:3] == ["trainer.seed", "chaos.interval"]


def test_command_line_value_replaces_a_presets_list(tmp_path: Path) -> None:
    write_multirun_yaml(
        tmp_path,
        ["+sweep=retry_policy", "checkpoint.retry.max_attempts=3"],
        {"checkpoint.retry.max_attempts": "1,2,4", "checkpoint.retry.initial_backoff": "0.1,0.5"},
    )

    assert declared_sweep_keys(str(tmp_path)) == ["checkpoint.retry.initial_backoff"]


def test_report_command_rebuilds_a_deleted_report(sweep_2x2: Path, capsys) -> None:
    build_sweep_report(str(sweep_2x2))
    before = (sweep_2x2 / SWEEP_CSV).read_text()
    for name in (SWEEP_CSV, SWEEP_MD, SWEEP_PNG):
        (sweep_2x2 / name).unlink()

    assert main([str(sweep_2x2)]) == 0

    assert (sweep_2x2 / SWEEP_CSV).read_text() == before
    assert (sweep_2x2 / SWEEP_MD).exists() and (sweep_2x2 / SWEEP_PNG).exists()
    assert "| 10 | 10 | 3 | succeeded |" in capsys.readouterr().out


def test_report_command_summarises_a_single_run_dir(tmp_path: Path, capsys) -> None:
    run_dir = write_job(
        tmp_path,
        "run",
        ["+experiment=digits_ft", "chaos=worker_killer"],
        summary(wall=12.5, chaos__kills=1),
    )

    assert main([str(run_dir)]) == 0

    out = capsys.readouterr().out
    assert "overrides: +experiment=digits_ft chaos=worker_killer" in out
    assert "succeeded" in out and "wall time 12.5 s" in out and "kills 1" in out
    assert not (run_dir / SWEEP_CSV).exists()


def test_report_command_refuses_a_dir_that_is_neither(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path)]) == 2
    assert "neither a run dir" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2


def test_callback_writes_the_report_into_the_sweep_dir(sweep_2x2: Path, capsys) -> None:
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_2x2)}}})

    SweepReportCallback().on_multirun_end(config)

    assert len(read_csv(sweep_2x2 / SWEEP_CSV)) == 4
    assert "sweep report:" in capsys.readouterr().out


def test_callback_does_not_raise_when_the_report_cannot_be_written(tmp_path: Path, caplog) -> None:
    # The jobs' results are on disk already; a broken report must not turn the sweep into a crash.
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "gone")}}})

    SweepReportCallback().on_multirun_end(config)

    assert "could not build the sweep report" in caplog.text


# The cheapest real job: one worker, 1 epoch of ~180 digits (6 steps), one checkpoint at the
# epoch end, validation only there. Ray's start and fit cost dominate (~20 s per job).


def run_sweep(args: list[str], sweep_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftjob", "-m", *CHEAP_JOB, *args, f"hydra.sweep.dir={sweep_dir}"],
        cwd=sweep_dir.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_a_sweep_whose_jobs_are_refused_reports_them_failed_and_exits_non_zero(
    tmp_path: Path,
) -> None:
    # Hydra's own launcher, jobs in this process: both jobs' storage fails its check before
    # Ray starts; each gets a failed summary naming the key, and the sweep exits 1.
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep(["checkpoint.storage_path=/dev/null/a,/dev/null/b"], sweep_dir)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = read_csv(sweep_dir / SWEEP_CSV)
    assert [(r["checkpoint.storage_path"], r["status"]) for r in rows] == [
        ("/dev/null/a", "failed"),
        ("/dev/null/b", "failed"),
    ]
    assert all("checkpoint.storage_path" in r["error"] for r in rows)


def test_the_launcher_records_a_job_that_ended_without_a_summary(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from ftjob.cli.launcher import SweepLauncher, _Running

    job_dir = tmp_path / "3"
    job_dir.mkdir()
    old = {"status": "interrupted", "name": "x", "error": "from the sweep before"}
    (job_dir / "summary.json").write_text(json.dumps(old))  # an earlier launch's
    (job_dir / "console.log").write_text("ftjob: error: the earlier launch's error\n")
    console_at = (job_dir / "console.log").stat().st_size
    launched = time.time() + 1  # the earlier summary predates this launch
    with open(job_dir / "console.log", "a") as f:
        f.write("ftjob: error: name='..': a run name must not climb out of its dir\n")
    launcher = SweepLauncher()
    launcher._job_config = lambda overrides: OmegaConf.create(  # type: ignore[method-assign]
        {"name": "..", "hydra": {"run": {"dir": "x"}}}
    )
    job = _Running(None, str(job_dir), 0.0, None, launched, console_at)  # type: ignore[arg-type]
    launcher._record_failure(job, ["name=.."], 2)
    s = json.loads((job_dir / "summary.json").read_text())
    assert s["status"] == "failed"
    assert s["error"] == "name='..': a run name must not climb out of its dir"

    # A job that wrote its own summary in this launch keeps it.
    launcher._record_failure(job._replace(launched=time.time() - 60), ["name=.."], 1)
    assert json.loads((job_dir / "summary.json").read_text()) == s


def test_previous_runs_of_a_resumed_sweep_are_kept_resumed_or_run(tmp_path: Path) -> None:
    from ftjob.cli.launcher import previous_run

    done = tmp_path / "0"
    done.mkdir()
    (done / "summary.json").write_text(json.dumps({"status": "succeeded", "name": "a"}))
    assert previous_run(str(done)) == ("succeeded", "a")
    cut = tmp_path / "1"  # Ctrl-C: a summary with the latest checkpoint
    cut.mkdir()
    summary = {"status": "interrupted", "name": "b", "checkpoints": {"latest": "x/step_5"}}
    (cut / "summary.json").write_text(json.dumps(summary))
    assert previous_run(str(cut)) == ("resume", "b")
    killed = tmp_path / "2"  # killed outright: only its committed checkpoints tell its name
    step = killed / "checkpoints" / "c" / "checkpoints" / "step_000000010"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    assert previous_run(str(killed)) == ("resume", "c")
    uncommitted = tmp_path / "3"
    (uncommitted / "checkpoints" / "d" / "checkpoints" / "step_000000010").mkdir(parents=True)
    assert previous_run(str(uncommitted)) == ("fresh", None)
    assert previous_run(str(tmp_path / "never")) == ("fresh", None)
