"""End-to-end preemption: a node drained with notice (Ray's drain API, as a spot reclaim),
SIGTERM to the driver and SIGTERM to a training worker. Each notice becomes a just-in-time
checkpoint of the current step: no step is lost, every sample is trained once, and (but for a
worker's exit, which Ray Train counts as a failure) the failure budget is not spent."""

from __future__ import annotations

import json
import os
import shlex
import signal

import pytest

from ftjob import metrics as M
from tests.conftest import read_until, run_ftjob, start_ftjob

pytestmark = pytest.mark.ray


def test_preemptions_with_notice_lose_no_step_and_spend_no_failure_budget(tmp_path):
    proc, s = run_ftjob(
        [
            "+experiment=digits_ft",
            "trainer.epochs=8",  # 176 steps
            "ray.local_nodes=3",
            "chaos=preempt",
            "chaos.at_steps=[30,110]",
            "chaos.notice=8",
            "failure.max_failures=0",  # a preemption must not need it
            "trainer.audit_samples=true",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert s["status"] == "succeeded"
    m = s["metrics"]
    assert (m[M.PREEMPTION_COUNT], m[M.PREEMPTION_LOST_STEPS], m[M.FAILURES_COUNT]) == (2, 0, 0)
    assert m[M.PREEMPTION_JIT_CHECKPOINT_TIME] > 0
    # Both preemptions happened; the last node may still await Ray's death notice at the end.
    preempts = s["chaos"]["kills"] + s["chaos"]["skipped"]
    assert [k["kind"] for k in preempts] == ["preempt", "preempt"]
    assert all(k.get("confirmed") or "before the run ended" in k["reason"] for k in preempts)
    for record in s["failures"]:
        assert record["kind"] == "preemption" and record["recovered"]
        assert record["lost_steps"] == 0
        assert record["restored_step"] == record["jit"]["step"] == record["notice"]["step"]
        assert record["notice"]["deadline"] > record["notice"]["received"]
        assert record["time"] == record["notice"]["deadline"] and record["time_to_recover_s"] > 0
    assert all(a["duplicates"] == 0 and a["missing"] == 0 for a in s["audit"])
    assert len(s["audit"]) == 8
    assert "preemption notice (drain)" in proc.stdout


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


def test_sigterm_to_the_driver_or_a_worker_saves_the_current_step(tmp_path):
    storage = tmp_path / "store"
    job = [
        "+experiment=digits_ft",
        "trainer.epochs=8",
        "name=term",
        f"checkpoint.storage_path={storage}",
        "trainer.audit_samples=true",
    ]
    run_dir = tmp_path / "first"
    first = start_ftjob(job, run_dir, tmp_path)
    lines: list[str] = []
    try:
        read_until(first, "checkpoint step 10 committed", lines, timeout=240)
        first.send_signal(signal.SIGTERM)  # Kubernetes, SLURM, ray job stop
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
    assert jit_step > 10 and s["checkpoints"]["latest"].endswith(f"step_{jit_step:09d}")
    assert s["metrics"][M.PREEMPTION_COUNT] == 1

    # The resumed run: SIGTERM to one of its training worker processes (a pod stopping it).
    run_dir = tmp_path / "resumed"
    resumed = start_ftjob(shlex.split(s["resume_command"])[3:], run_dir, tmp_path)
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
    assert resumed.returncode == 0, "".join(lines)[-4000:]
    s2 = json.loads((run_dir / "summary.json").read_text())
    assert s2["status"] == "succeeded"
    [by_worker] = s2["failures"]
    assert by_worker["kind"] == "preemption" and by_worker["notice"]["source"] == "worker"
    assert by_worker["lost_steps"] == 0 and by_worker["jit"]["path"]
    first_epoch = s2["audit"][0]
    steps_per_epoch = 22
    assert first_epoch["resumed_at"] == (jit_step % steps_per_epoch) * 64  # nothing re-trained
    assert all(a["duplicates"] == 0 and a["missing"] == 0 for a in s2["audit"])


def test_a_notice_during_an_upload_or_a_validation_still_loses_no_step(tmp_path):
    # Every checkpoint upload request takes 1 s (5 files: ~5 s a checkpoint), and validation
    # (at epoch ends only) decodes 8000 images each time: both outlast the time a notice takes
    # to arrive (the killer's poll, then the drain relay's poll, ~1.5 s). The first notice comes
    # during the checkpoint of step 30, the second during the validation of step 44 (the end of
    # epoch 2).
    proc, s = run_ftjob(
        [
            "+experiment=digits_ft",
            "dataset=synthetic",
            "dataset.num_samples=1408",  # 22 steps an epoch, as digits
            "dataset.num_val_samples=8000",
            "dataset.image_size=64",
            "dataset.num_classes=10",
            "trainer.validation_cache_mb=0",
            "trainer.validate_every_n_steps=0",
            "trainer.checkpoint_every_n_steps=30",
            "trainer.epochs=3",
            "ray.local_nodes=3",
            "chaos=preempt",
            "chaos.at_steps=[30,44]",
            "chaos.notice=10",
            "chaos.storage.upload_delay=1.0",
            "trainer.audit_samples=true",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert s["status"] == "succeeded"
    during_upload, during_validation = s["failures"]
    for record in (during_upload, during_validation):
        assert record["kind"] == "preemption" and record["lost_steps"] == 0
        # The periodic checkpoint of the step in flight became the just-in-time one.
        assert record["jit"]["reused"] and record["restored_step"] == record["notice"]["step"]
    assert during_upload["notice"]["step"] == 30
    assert during_validation["notice"]["validation_cut"] == 44
    assert [v["step"] for v in s["validation"]] == [22, 44, 66]  # 44 again after the restart
    assert all(a["duplicates"] == 0 and a["missing"] == 0 for a in s["audit"])
    assert s["metrics"][M.FAILURES_COUNT] == 0
