"""End-to-end preemption: SIGTERM to the driver and SIGTERM to a training worker. Each notice
becomes a just-in-time checkpoint of the current step: no step is lost, every sample is trained
once. Also: one driver per run, and a resume past a damaged checkpoint. (A node drained with
notice, Ray's drain API, is in the S3 run: test_s3.py.)"""

from __future__ import annotations

import json
import os
import shlex
import signal
from pathlib import Path

import pytest

from ftjob import metrics as M
from ftjob.reporting.summary import exactly_once
from tests.helpers import read_until, run_ftjob, start_ftjob

pytestmark = pytest.mark.ray


def train_worker_pids(root: int) -> list[int]:
    """Ray Train worker processes below process ``root`` (an embedded Ray's are its children's
    children)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    if b"RayTrainWorker" in f.read():
                        found.append(child)
            except OSError:
                continue
    return sorted(found)


def test_sigterm_to_the_driver_then_a_resume_past_a_damaged_checkpoint_and_a_worker_sigterm(
    tmp_path,
):
    """A driver told to stop (SIGTERM: Kubernetes, SLURM, ray job stop) saves its current step
    and says how to resume, while a second driver for the run is refused; the resume falls
    back past a damaged checkpoint (quarantined, never deleted), a SIGTERM to one of its
    training workers (a pod stopping it) saves that step too, and every sample is trained once."""
    storage = tmp_path / "store"
    job = [
        "+experiment=digits_ft",
        "trainer.epochs=3",
        "name=term",
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
        read_until(first, "checkpoint step 20 committed", lines, timeout=240)
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=120)
        lines.append(out)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, "".join(lines)[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "preempted"
    assert "after a just-in-time checkpoint of step" in s["error"]
    jit_step = int(s["error"].rsplit(" ", 1)[-1])
    latest = s["checkpoints"]["latest"]
    assert jit_step > 20 and latest.endswith(f"step_{jit_step:09d}")
    assert s["metrics"][M.PREEMPTION_COUNT] == 1
    command = s["resume_command"]
    assert "name=term" in command and "resume=true" in command and "trainer.epochs=3" in command
    assert any("to continue from" in line for line in lines)

    # The just-in-time checkpoint is damaged while nobody runs: the resume must fall back to
    # the one before it.
    jit_dir = Path(latest.removeprefix("file://"))
    before = max(
        int(p.name.removeprefix("step_"))
        for p in jit_dir.parent.glob("step_*")
        if int(p.name.removeprefix("step_")) < jit_step
    )
    model = jit_dir / "model.pt"
    model.write_bytes(model.read_bytes()[:100])
    run_dir = tmp_path / "resumed"
    resumed = start_ftjob(shlex.split(command)[3:], run_dir, tmp_path)
    lines = []
    try:
        read_until(resumed, "loss", lines, timeout=240)  # a progress line: training again
        [worker, *_] = train_worker_pids(resumed.pid)
        os.kill(worker, signal.SIGTERM)
        out, _ = resumed.communicate(timeout=240)
        lines.append(out)
    finally:
        if resumed.poll() is None:
            resumed.kill()
    console = "".join(lines)
    assert resumed.returncode == 0, console[-4000:]
    s2 = json.loads((run_dir / "summary.json").read_text())
    assert s2["status"] == "succeeded"
    [fallback] = s2["checkpoints"]["fallbacks"]
    assert fallback["path"] == str(jit_dir) and fallback["committed"]
    assert Path(fallback["quarantined_to"], "QUARANTINED.json").exists()
    assert Path(fallback["quarantined_to"], "model.pt").exists()  # evidence kept
    assert "not usable" in console and "fell back" in console
    [by_worker] = s2["failures"]
    assert by_worker["kind"] == "preemption" and by_worker["notice"]["source"] == "worker"
    assert by_worker["lost_steps"] == 0 and by_worker["jit"]["path"]
    steps_per_epoch = 22
    assert s2["audit"][0]["resumed_at"] == (before % steps_per_epoch) * 64  # nothing re-trained
    assert s2["audit"][-1]["epoch"] == 2 and all(exactly_once(a) for a in s2["audit"])
