"""A real sweep on Ray, interrupted (Ctrl-C) and resumed: finished jobs are not run again, and
the report covers every job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftjob import metrics as M
from ftjob.reporting.sweep import (
    SWEEP_CSV,
    SWEEP_MD,
    SWEEP_PNG,
)
from tests.support.processes import ctrl_c_reaches_it
from tests.support.sweeps import CHEAP_JOB, PNG_MAGIC, job_summary, read_csv


@pytest.mark.ray
def test_an_interrupted_sweep_resumes_without_running_finished_jobs_and_reports(
    tmp_path: Path,
) -> None:
    """ftjob's launcher end to end: a sweep stopped with Ctrl-C, resumed (finished jobs kept,
    the interrupted one resumed), its jobs in runs and checkpoints of their own, jobs whose
    storage fails its check (before Ray starts) reported as failed while the others run, the
    sweep's exit status non-zero for them, and its report: CSV, Markdown, plots, rebuilt by
    the report command."""
    sweep_dir = tmp_path / "sweep"
    args = [
        sys.executable,
        "-m",
        "ftjob",
        "-m",
        *CHEAP_JOB,
        "trainer.lr=0.001,0.002",
        "checkpoint.storage_path=null,/dev/null/ckpt",  # every second job fails its check
        "hydra/launcher=ftjob",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    first = subprocess.Popen(
        [*args, "hydra.launcher.max_concurrent=1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: Ctrl-C reaches the sweep and its jobs
        preexec_fn=ctrl_c_reaches_it,
    )
    try:
        deadline = time.monotonic() + 300
        while not (sweep_dir / "0" / "summary.json").exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        os.killpg(first.pid, signal.SIGINT)
        first.wait(timeout=180)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    kept = (sweep_dir / "0" / "summary.json").read_text()
    assert not (sweep_dir / "1" / "summary.json").exists() or (
        json.loads((sweep_dir / "1" / "summary.json").read_text())["status"] != "succeeded"
    )  # the second job did not finish

    resumed = subprocess.run(
        [*args, "hydra.launcher.max_concurrent=2", "hydra.launcher.resume=true"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 1, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "[sweep] job 0: succeeded before, kept" in resumed.stdout
    assert "[sweep] job 0 (" not in resumed.stdout  # never started again...
    assert (sweep_dir / "0" / "summary.json").read_text() == kept  # ...nor overwritten

    rows = read_csv(sweep_dir / SWEEP_CSV)
    assert [(r["trainer.lr"], r["checkpoint.storage_path"], r["status"]) for r in rows] == [
        ("0.001", "null", "succeeded"),
        ("0.001", "/dev/null/ckpt", "failed"),
        ("0.002", "null", "succeeded"),
        ("0.002", "/dev/null/ckpt", "failed"),
    ]
    ran, failed = rows[0::2], rows[1::2]
    assert all("checkpoint.storage_path" in r["error"] for r in failed)
    assert all(float(r[M.VALIDATION_ACCURACY]) > 0 for r in ran)
    assert all(0 < float(r["goodput/ettr"]) < 1 for r in ran)  # measured, not a placeholder
    table = (sweep_dir / SWEEP_MD).read_text()
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 5
    assert "| 1 | 0.001 | /dev/null/ckpt | failed |" in table
    assert (sweep_dir / SWEEP_PNG).read_bytes()[:8] == PNG_MAGIC
    assert (sweep_dir / "sweep_goodput.png").read_bytes()[:8] == PNG_MAGIC
    assert "sweep report:" in resumed.stdout

    # Each job trained its own run, checkpointed under its own dir.
    summaries = {job: job_summary(sweep_dir, job) for job in ("0", "2")}
    assert len({s["name"] for s in summaries.values()}) == 2
    for job, s in summaries.items():
        assert s["checkpoints"]["committed"] >= 1
        assert s["checkpoints"]["latest"].startswith(str(sweep_dir / job / "checkpoints") + os.sep)
    assert summaries["0"]["metrics"][M.CHECKPOINT_RESTORATION_TIME] == 0  # started fresh

    # The report command rebuilds a deleted report from the job dirs alone.
    before = (sweep_dir / SWEEP_CSV).read_text()
    (sweep_dir / SWEEP_CSV).unlink()
    rebuilt = subprocess.run(
        [sys.executable, "-m", "ftjob.report", str(sweep_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (sweep_dir / SWEEP_CSV).read_text() == before
