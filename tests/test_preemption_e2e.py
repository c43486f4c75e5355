"""End-to-end preemption: nodes drained with notice (Ray's drain API, as a spot reclaim) during
an upload and a validation, SIGTERM to the driver and SIGTERM to a training worker. Each
notice becomes a just-in-time checkpoint of the current step: no step is lost, every sample is
trained once, and the failure budget is not spent. Also: one driver per run, and a resume past
a damaged checkpoint."""

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
        "trainer.epochs=4",
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
    assert "name=term" in command and "resume=true" in command and "trainer.epochs=4" in command
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
    assert s2["audit"][-1]["epoch"] == 3 and all(exactly_once(a) for a in s2["audit"])


def test_drain_notices_during_an_upload_or_a_validation_lose_no_step_nor_failure_budget(
    tmp_path,
):
    # Nodes drained with notice (Ray's drain API, as a spot reclaim). Every checkpoint upload
    # request takes 1 s (5 files: ~5 s a checkpoint), and validation (at epoch ends only)
    # decodes 4000 images each time (~10 s here): both outlast the time a notice takes to arrive (the
    # killer's poll, then the drain relay's poll, ~1.5 s). The first notice comes during the
    # checkpoint of step 30, the second during the validation of step 44 (the end of epoch 2).
    proc, s = run_ftjob(
        [
            "+experiment=digits_ft",
            "dataset=synthetic",
            "dataset.num_samples=1408",  # 22 steps an epoch, as digits
            "dataset.num_val_samples=4000",
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
    during_upload, during_validation = s["failures"]
    for record in (during_upload, during_validation):
        assert record["kind"] == "preemption" and record["recovered"]
        assert record["lost_steps"] == 0 and record["notice"]["source"] == "drain"
        # The periodic checkpoint of the step in flight became the just-in-time one.
        assert record["jit"]["reused"] and record["restored_step"] == record["notice"]["step"]
        assert record["restored_step"] == record["jit"]["step"]
        assert record["notice"]["deadline"] > record["notice"]["received"]
        assert record["time"] == record["notice"]["deadline"] and record["time_to_recover_s"] > 0
    assert during_upload["notice"]["step"] == 30
    assert during_validation["notice"]["validation_cut"] == 44
    assert [v["step"] for v in s["validation"]] == [22, 44, 66]  # 44 again after the restart
    assert len(s["audit"]) == 3 and all(exactly_once(a) for a in s["audit"])
    assert "preemption notice (drain)" in proc.stdout
