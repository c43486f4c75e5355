"""End-to-end signals on Ray: a resume past a damaged checkpoint by one driver (a second is
refused), a SIGTERM to a training worker, a notice with a just-in-time checkpoint of the
current step (no step lost, every sample trained once); then SIGSTOP to a training worker: a
hang, found by its silence, its stack read, the worker SIGKILLed and the group restarted by
Ray Train. (SIGTERM to the driver, as `ray job stop` sends it, is in test_e2e.py; a node
drained with notice, Ray's drain API, in the S3 run: test_s3.py; a slow rank named as a
straggler, a slow upload that is no hang and the restart-loop guard are tested in-process:
test_worker_local.py; the hang and straggler decisions in test_hang.py.)"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from ftjob import metrics as M
from ftjob.record import RunSnapshot
from ftjob.reporting.summary import exactly_once
from ftjob.storage.checkpoint import manifest_of
from tests.helpers import compose_job, read_until, start_ftjob
from tests.local_run import run_locally, stop_when

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


def past_a_committed_step_20(snap: RunSnapshot) -> bool:
    """A checkpoint of step 20 or later committed, and a step trained after it."""
    committed = [c.step for c in snap.committed()]
    return max(committed, default=0) >= 20 and any(
        a.max_step > max(committed) for a in snap.attempts
    )


def test_a_resume_past_a_damaged_checkpoint_one_driver_a_worker_sigterm_and_a_hang(tmp_path):
    """A run stopped with a just-in-time checkpoint (the driver told to stop, here in-process;
    `ray job stop`, a SIGTERM to a real driver, is test_e2e.py's) is resumed by a driver on
    Ray: it falls back past the damaged just-in-time checkpoint (quarantined, never deleted)
    while a second driver for the run is refused, naming the holder; a SIGTERM to one of its
    training workers (a pod stopping it) saves that step; a worker stopped later (SIGSTOP) is
    found hung within 30 s by the learned timeouts; every sample is trained once."""
    storage = tmp_path / "store"
    job = [
        "+experiment=digits_ft",
        "trainer.epochs=3",
        "name=term",
        f"checkpoint.storage_path={storage}",
        "trainer.audit_samples=true",
    ]
    first = run_locally(
        compose_job(*job),
        tmp_path / "first",
        during=stop_when(past_a_committed_step_20),
    )
    s = first.summary
    assert s["status"] == "preempted", (s["error"], first.errors)
    jit_step = int(s["error"].rsplit(" ", 1)[-1])
    latest = s["checkpoints"]["latest"]
    assert jit_step > 20 and latest.endswith(f"step_{jit_step:09d}")

    # The just-in-time checkpoint is damaged while nobody runs: the resume must fall back to
    # the one before it.
    jit_dir = Path(latest.removeprefix("file://"))
    before = max(
        int(p.name.removeprefix("step_"))
        for p in jit_dir.parent.glob("step_*")
        if int(p.name.removeprefix("step_")) < jit_step
    )
    manifest = json.loads((jit_dir / manifest_of(os.listdir(jit_dir))).read_text())
    model = jit_dir / manifest["files"]["model.pt"]["object"]
    model.write_bytes(model.read_bytes()[:100])
    run_dir = tmp_path / "resumed"
    # The resumed run also stops a worker at step 50 (of 66; the killer sees it at that
    # progress line): after the worker SIGTERM's restart (~step 32) and the new attempt's
    # settling steps, so its timeouts are learned, and mid-epoch.
    hang = ["chaos=hang", "chaos.at_steps=[50]"]
    resumed = start_ftjob([*job, "resume=true", *hang], run_dir, tmp_path)
    second = None
    lines: list[str] = []
    try:
        read_until(resumed, "checkpoints: ", lines, timeout=120)
        # A second driver for the same run, while the first lives: refused, naming the holder
        # (in the background: the first's console is read on meanwhile).
        second = start_ftjob([*job, "resume=true"], tmp_path / "second", tmp_path)
        read_until(resumed, "loss", lines, timeout=240)  # a progress line: training again
        [worker, *_] = train_worker_pids(resumed.pid)
        os.kill(worker, signal.SIGTERM)
        refused, _ = second.communicate(timeout=120)
        out, _ = resumed.communicate(timeout=240)
        lines.append(out)
    finally:
        for proc in (resumed, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert second.returncode == 2, refused[-3000:]
    assert "being trained by another driver" in refused and f":{resumed.pid}" in refused
    console = "".join(lines)
    assert resumed.returncode == 0, console[-4000:]
    s2 = json.loads((run_dir / "summary.json").read_text())
    assert s2["status"] == "succeeded"
    [fallback] = s2["checkpoints"]["fallbacks"]
    assert fallback["path"] == str(jit_dir) and fallback["committed"]
    assert Path(fallback["quarantined_to"], "QUARANTINED.json").exists()
    assert Path(fallback["quarantined_to"], model.name).exists()  # evidence kept
    assert "not usable" in console and "fell back" in console
    by_worker, hung = s2["failures"]
    assert by_worker["kind"] == "preemption" and by_worker["notice"]["source"] == "worker"
    assert by_worker["lost_steps"] == 0 and by_worker["jit"]["path"]
    steps_per_epoch = 22
    assert s2["audit"][0]["resumed_at"] == (before % steps_per_epoch) * 64  # nothing re-trained
    assert s2["audit"][-1]["epoch"] == 2 and all(exactly_once(a) for a in s2["audit"])

    [stop] = s2["chaos"]["kills"]
    assert stop["kind"] == "hang"
    [hang] = s2["hangs"]
    assert hang["rank"] == stop["target"]["rank"] and hang["pid"] == stop["target"]["pid"]
    assert hang["heartbeats_stopped"] and hang["killed"]
    # Found by the default, learned timeouts within 30 s of the stop.
    assert hang["learned"] and hang["time"] - stop["time"] < 30.0
    assert hang["stack_source"] == "py-spy" and "ftjob/worker/loop.py" in hang["stack"]
    assert hung["kind"] == "hang" and hung["recovered"] and hung["detail"]["rank"] == hang["rank"]
    assert s2["metrics"][M.HANG_COUNT] == 1
    assert 0 < s2["metrics"][M.HANG_DETECTION_TIME] < 30.0
    assert "hang: rank" in console and "stack captured (py-spy)" in console
    assert "data: rank 0 decodes in" in console  # where, and why (trainer.decode_in=auto)
    assert "A worker died or was killed" not in console  # Ray's paragraph stays in its logs
