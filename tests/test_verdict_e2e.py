"""End-to-end: a run's status tells the truth. A diverged run fails at once and is not retried;
async uploads that keep failing end the run on every rank together; an interrupted run keeps
its record and resumes past a damaged checkpoint, which is quarantined, never deleted; one
driver per run."""

from __future__ import annotations

import json
import shlex
import signal
import threading
from pathlib import Path

import pytest

from ftjob import metrics as M
from tests.conftest import read_until, run_ftjob, start_ftjob

pytestmark = pytest.mark.ray


def test_a_diverged_run_stops_as_failed_and_is_not_retried(tmp_path):
    proc, s = run_ftjob(
        ["+experiment=digits_ft", "trainer.epochs=2", "optimizer=sgd", "trainer.lr=1e12"],
        tmp_path,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert s["status"] == "failed"
    assert s["error"].startswith("training diverged: the loss became non-finite (nan) by step 10")
    assert s["metrics"][M.TRAIN_LOSS] is None  # null, never 0
    assert s["metrics"][M.FAILURES_COUNT] == 0 and s["attempts"] == 1  # not retried
    assert s["checkpoints"]["committed"] == 0  # no diverged weights were written
    assert "loss null" in proc.stdout


def test_async_uploads_failing_past_the_budget_end_the_run_on_every_rank(tmp_path):
    proc, s = run_ftjob(
        [
            "+experiment=digits_ft",
            "trainer.epochs=2",
            "checkpoint.upload_mode=async",
            "checkpoint.max_consecutive_upload_failures=1",
            "chaos.storage.errors=[permanent]",  # denied checkpoint uploads, nothing else
            "chaos.storage.failure_rate=0.5",
            "checkpoint.retry.max_attempts=1",
        ],
        tmp_path,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert s["status"] == "failed"
    assert "checkpoint upload(s) in a row failed" in s["error"]
    assert "checkpoint.max_consecutive_upload_failures=1" in s["error"]
    # Both ranks returned together (rank 0 broadcast the decision): no worker failed, no retry.
    assert s["failures"] == [] and s["attempts"] == 1
    assert s["checkpoints"]["failed"] >= 2
    assert s["metrics"][M.CHECKPOINT_UPLOAD_FAILURES] >= 2


def test_an_interrupted_run_keeps_its_record_and_resumes_past_a_damaged_checkpoint(tmp_path):
    storage = tmp_path / "store"
    job = [
        "+experiment=digits_ft",
        "trainer.epochs=8",
        "name=intr",
        f"checkpoint.storage_path={storage}",
        "trainer.audit_samples=true",
    ]
    run_dir = tmp_path / "first"
    first = start_ftjob(job, run_dir, tmp_path)
    lines: list[str] = []
    try:
        read_until(first, "checkpoints: ", lines, timeout=120)
        # A second driver for the same run, while the first lives: refused, naming the holder.
        second, _ = run_ftjob(job, tmp_path / "second", timeout=120)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert "being trained by another driver" in second.stderr
        assert f":{first.pid}" in second.stderr
        read_until(first, "checkpoint step 30 committed", lines, timeout=240)
        first.send_signal(signal.SIGINT)
        rest = threading.Thread(target=lambda: lines.extend(first.stdout or []), daemon=True)
        rest.start()
        assert first.wait(timeout=60) == 130, "".join(lines[-40:])
        rest.join(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "interrupted" and "Ctrl-C" in s["error"]
    latest = s["checkpoints"]["latest"]
    assert latest is not None and latest.startswith(str(storage))
    command = s["resume_command"]
    assert "name=intr" in command and "resume=true" in command and "trainer.epochs=8" in command
    assert any("to continue from" in line for line in lines)

    # The newest checkpoint is damaged while nobody runs: the resume falls back to the one
    # before, moves the damaged one aside, re-trains and ends with every sample once.
    model = Path(latest.removeprefix("file://")) / "model.pt"
    model.write_bytes(model.read_bytes()[:100])
    args = shlex.split(command)[3:]  # python -m ftjob ...
    resumed, s2 = run_ftjob(args, tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    assert s2["status"] == "succeeded"
    [fallback] = s2["checkpoints"]["fallbacks"]
    assert fallback["path"] == latest.removeprefix("file://") and fallback["committed"]
    assert Path(fallback["quarantined_to"], "QUARANTINED.json").exists()
    assert Path(fallback["quarantined_to"], "model.pt").exists()  # evidence kept
    assert all(
        a["duplicates"] == 0 and a["missing"] == 0 and a["unexpected"] == 0 for a in s2["audit"]
    )
    assert s2["audit"][-1]["epoch"] == 7
    assert "not usable" in resumed.stdout and "fell back" in resumed.stdout
