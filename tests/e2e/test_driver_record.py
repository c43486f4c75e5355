"""The run's record outlives what happens under the driver: an embedded Ray whose raylet is
SIGKILLed mid-run (the OOM killer, another user's ``ray stop``) takes the run ledger with it,
and the driver still writes summary.json from the record it keeps on its side -- failed,
saying that Ray died, with the committed checkpoint and the command that continues the run;
a driver SIGKILLed mid-run leaves that record in its run dir, and ``python -m ftjob.report``
rebuilds its summary from it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftjob.driver.held_record import PULL_EVERY_S
from ftjob.reporting.run_record import read_record
from tests.support.processes import read_until, start_ftjob
from tests.support.summaries import checked

pytestmark = pytest.mark.ray


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from /proc: each process's children, depth first)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:  # the task ended meanwhile
                continue
            for child in map(int, children):
                found.append(child)
                todo.append(child)
    return found


def raylet_of(driver: int) -> int:
    """The pid of the raylet the driver's embedded Ray started (its child process whose
    command is ``raylet``): the one process this test kills."""
    for pid in descendants(driver):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if os.path.basename(command) == b"raylet":
            return pid
    raise AssertionError(f"no raylet under the driver (pid {driver})")


def job_args(storage: Path, name: str) -> list[str]:
    """The digits run with its memory tier (2 workers, a snapshot holder), a checkpoint every
    4 steps, a line every step: long enough (8 epochs of 22 steps) that a kill lands mid-run."""
    return [
        "experiment=digits_ft",
        f"name={name}",
        f"checkpoint.storage_path={storage}",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.log_every_n_steps=1",
        "trainer.validate_every_n_steps=0",
    ]


def test_a_run_whose_embedded_ray_dies_writes_its_summary_from_the_drivers_record(
    tmp_path: Path,
) -> None:
    storage, run_dir = tmp_path / "ckpt", tmp_path / "run"
    proc = start_ftjob(job_args(storage, "raydies"), run_dir, tmp_path)
    lines: list[str] = []
    try:
        read_until(proc, "checkpoint step 8 committed", lines, timeout=400)
        os.kill(raylet_of(proc.pid), signal.SIGKILL)
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    console = "".join(lines) + rest
    summary_path = run_dir / "summary.json"
    assert summary_path.exists(), console[-4000:]
    s = checked(json.loads(summary_path.read_text()))
    assert proc.returncode == 1, console[-3000:]
    assert s["status"] == "failed"
    assert "Ray died" in s["error"] and "raylet" in s["error"], s["error"]
    # What was committed before Ray died: the newest checkpoint in storage, at least step 8,
    # and the command that continues from it.
    latest = s["checkpoints"]["latest"]
    assert latest and int(latest.rstrip("/").rsplit("_", 1)[1]) >= 8, s["checkpoints"]
    assert s["checkpoints"]["committed"] >= 2
    assert "name=raydies" in s["resume_command"] and "resume=true" in s["resume_command"]
    # The record the driver held: the steps trained before the kill, the run's attempt.
    assert s["metrics"]["train/steps_completed"] >= 8
    assert s["attempts"] >= 1
    assert "Ray died" in console and "to continue from" in console, console[-3000:]


def test_a_killed_drivers_record_in_its_run_dir_rebuilds_its_summary(tmp_path: Path) -> None:
    storage, run_dir = tmp_path / "ckpt", tmp_path / "run"
    proc = start_ftjob(
        [*job_args(storage, "killed"), "trainer.audit_samples=true"], run_dir, tmp_path
    )
    lines: list[str] = []
    try:
        read_until(proc, "checkpoint step 8 committed", lines, timeout=400)
        read_until(proc, " loss ", lines, timeout=60)
        printed = int(re.findall(r" step (\d+)/\d+ loss ", lines[-1])[0])
        since = time.monotonic()
        # The step the console printed reaches the run dir's record within a pull or two.
        while not _audited(run_dir, printed):
            assert time.monotonic() - since < 5 * PULL_EVERY_S, "the record lags the console"
            read_until(proc, "\n", lines, timeout=60)
        os.kill(proc.pid, signal.SIGKILL)  # the driver only: its Ray goes with it
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (run_dir / "summary.json").exists()
    kept = read_record(str(run_dir))
    assert kept is not None and kept.end is None
    assert max(a.step for a in kept.snapshot.audit) >= printed
    assert kept.snapshot.progress is not None and kept.snapshot.progress.step >= printed
    report = subprocess.run(
        [sys.executable, "-m", "ftjob.report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = report.stdout
    assert report.returncode == 0, report.stderr[-3000:]
    assert "rebuilt from" in out and "the driver did not end" in out, out
    assert "run killed: failed" in out and "audit epoch 0: unique" in out, out
    assert "name=killed resume=true" in out, out
    steps = int(re.findall(r"steps (\d+) \(", out)[0])
    assert steps >= printed, out


def _audited(run_dir: Path, step: int) -> bool:
    """Does the run dir's record hold every rank's samples of ``step``?"""
    kept = read_record(str(run_dir))
    audited = [a for a in kept.snapshot.audit if a.step == step] if kept else []
    return bool(audited) and len(audited[-1].ids) == 64  # two ranks x batch 32
