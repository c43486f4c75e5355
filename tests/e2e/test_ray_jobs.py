"""End-to-end runs on a real Ray: jobs submitted to, stopped on and shown by an existing
cluster started with `ray start --head` (the cluster extra: dashboard and job server); the
stopped job resumed on that cluster by its printed command, past a damaged checkpoint, through a
worker SIGTERM and a hang; a driver of that run SIGKILLed and its command submitted again. (Restores, mid-epoch resumption, exact-once and resume=true are tested
in-process too: tests/worker/test_worker_local.py; a node drained with notice, Ray's drain API,
in the S3 run: test_s3_run.py; a slow rank named as a straggler, a slow upload that is no hang
and the restart-loop guard in-process: tests/worker/test_worker_local.py; the hang and straggler
decisions in tests/unit/policy/test_hang.py.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import fsspec
import pytest

from ftjob import metrics as M
from ftjob.storage.checkpoint import manifest_of
from ftjob.storage.identity import run_identity
from tests.support.images import digits_tree
from tests.support.processes import read_until, start_ftjob
from tests.support.summaries import exactly_once

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The ``ray`` command, as a user of a cluster with token authentication runs it."""
    ray = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "RAY_AUTH_MODE": "token"}  # find the token `ray start` wrote
    return subprocess.run([ray, *args], capture_output=True, text=True, timeout=timeout, env=env)


def submit(*args: str) -> subprocess.CompletedProcess[str]:
    """`ray job submit`, again while the head's job agent is still starting (the dashboard
    answers a few seconds before it: "No available agent to submit job, please try again
    later"; minutes on a loaded machine: the bound only ends a wait that would never end)."""
    deadline = time.monotonic() + 300
    while True:
        done = ray_cli("job", "submit", *args)
        if "try again later" not in done.stderr or time.monotonic() > deadline:
            return done
        time.sleep(2)


def dashboard_get(port: int, path: str) -> Any:
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def job_logs(port: int, submission_id: str) -> str:
    """A job's logs so far ("" while the dashboard cannot answer: asked again)."""
    try:
        return str(dashboard_get(port, f"/api/jobs/{submission_id}/logs")["logs"])
    except (urllib.error.URLError, TimeoutError, KeyError):
        return ""


def complete_logs(port: int, submission_id: str) -> str:
    """The logs of a job that ended (its driver exited: nothing more comes), asked again while
    the dashboard cannot answer."""
    deadline = time.monotonic() + 120
    while not (logs := job_logs(port, submission_id)):
        assert time.monotonic() < deadline, f"the dashboard never gave {submission_id}'s logs"
        time.sleep(1)
    return logs


def head_node(port: int, dashboard: int, temp_dir: str) -> subprocess.Popen[bytes]:
    """`ray start --head --block` with its dashboard and job server on loopback, in a process
    group of its own (ended by the caller, by pid); returns once the dashboard answers. Its
    ``temp_dir`` and ports are its own: the job server finds the cluster its drivers join
    ("auto") in that dir's ray_current_cluster, which a Ray started elsewhere on this machine
    meanwhile would otherwise have rewritten (a job's driver then joined that cluster)."""
    ray = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [
            ray,
            "start",
            "--head",
            f"--port={port}",
            f"--temp-dir={temp_dir}",
            # Ports Ray would otherwise take at fixed numbers (52365, 10001): another Ray on
            # this machine holding one leaves the head without its job agent ("No available
            # agent to submit job") or client server.
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            "--disable-usage-stats",
            "--block",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # `ray job stop` sends SIGTERM, then SIGKILL after this (Ray's default: 3 s): the
        # just-in-time checkpoint and the summary need longer on a loaded machine.
        env={**os.environ, "RAY_JOB_STOP_WAIT_TIME_S": "60"},
    )
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=2)
            return head
        except urllib.error.HTTPError:  # it answers (401 without the token): up
            return head
        except OSError:
            assert head.poll() is None and time.monotonic() < deadline, "the head did not start"
            time.sleep(0.5)


def ray_train_workers(root: int) -> list[int]:
    """Live Ray Train worker processes below process ``root`` (the head's: its raylet starts
    them), none of another Ray's on this machine."""
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


def test_ray_jobs_on_a_head_started_with_ray_start_run_stop_resume_and_show_on_the_dashboard(
    tmp_path, monkeypatch
):
    """As on a user's cluster: `ray start --head` with its dashboard and job server; a job
    on real image files (the digits as PNGs), submitted with `ray job submit --working-dir`,
    stopped with `ray job stop` once it committed a checkpoint: a preemption notice, a
    just-in-time checkpoint, status preempted, the resume command (printed, and in the summary),
    no training worker left. That command, rerun on the cluster by a driver of its own (as a
    scheduler reruns a job) once the just-in-time checkpoint was damaged, falls back past it
    (quarantined, never deleted) while a second driver for the run is refused, naming the
    holder; a SIGTERM to one of its training workers (a pod stopping it) saves that step; a
    worker stopped later (SIGSTOP) is found hung within 30 s by the learned timeouts; every
    sample is trained once. Then a driver of the run with the memory tier on is SIGKILLed while
    the cluster lives on, and the unchanged command, submitted and waited for, continues from
    the snapshots its holders kept, decoding on Ray Data, succeeds and leaves the cluster up;
    the dashboard's Train view lists it (:func:`driver_killed_with_the_cluster_kept`)."""
    port, dashboard = _free_port(), _free_port()
    address = f"http://127.0.0.1:{dashboard}"
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    head = head_node(port, dashboard, temp_dir)
    try:
        working_dir = tmp_path / "wd"
        working_dir.mkdir()
        (working_dir / "NOTES").write_text("the job's working dir, shipped by ray job submit\n")
        storage = [
            f"checkpoint.storage_path={tmp_path / 'ckpt'}",
            "checkpoint.shared_filesystem=true",
        ]
        where = ["--address", address, "--working-dir", str(working_dir)]
        # Real image files: the digits run's images as PNGs (its 22 steps of 64 an epoch).
        images = [
            "dataset=imagefolder",
            f"dataset.path={digits_tree(tmp_path / 'digits')}",
            "dataset.image_size=32",  # as dataset=digits renders them
            "dataset.resize_size=32",
            "dataset.augment=false",
            "dataset.num_classes=10",
        ]

        # A second job, stopped with `ray job stop` once it committed a checkpoint.
        long = [
            "+experiment=digits_ft",
            *images,
            "trainer.epochs=30",
            "trainer.audit_samples=true",
            "ray.address=auto",
            *storage,
        ]
        entry = [
            sys.executable,
            "-m",
            "ftjob",
            *long,
            "name=stopped",
            f"hydra.run.dir={tmp_path / 'run2'}",
        ]
        started = submit(*where, "--no-wait", "--submission-id", "ftjob-stopped", "--", *entry)
        assert started.returncode == 0, started.stderr[-3000:]
        deadline = time.monotonic() + 240
        # Read through the dashboard's REST API: a `ray job logs` per poll is a Python process
        # (~2 s of CPU) taken from the job on a small machine.
        while "checkpoint step 10 committed" not in job_logs(dashboard, "ftjob-stopped"):
            assert time.monotonic() < deadline, "the second job never committed a checkpoint"
            time.sleep(1)
        stopped = ray_cli("job", "stop", "--address", address, "ftjob-stopped")
        assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
        # `ray job stop` returns once the job is STOPPED, which Ray's job supervisor records
        # only after the driver exited (on its SIGTERM, or SIGKILLed RAY_JOB_STOP_WAIT_TIME_S
        # later): everything the driver printed is in the job's log by now.
        assert dashboard_get(dashboard, "/api/jobs/ftjob-stopped")["status"] == "STOPPED"
        s = json.loads((tmp_path / "run2" / "summary.json").read_text())
        assert s["status"] == "preempted", s["error"]
        assert "after a just-in-time checkpoint of step" in s["error"]
        jit_step = int(s["error"].rsplit(" ", 1)[-1])
        assert jit_step >= 10 and s["checkpoints"]["latest"].endswith(f"step_{jit_step:09d}")
        command = s["resume_command"]
        assert "resume=true" in command and "name=stopped" in command
        assert "trainer.epochs=30" in command and "ray.address=auto" in command
        assert s["metrics"][M.PREEMPTION_COUNT] == 1
        logs = complete_logs(dashboard, "ftjob-stopped")
        assert f"to continue from {s['checkpoints']['latest']}: {command}" in logs, logs[-3000:]
        assert "data: rank 0 decodes in" in logs  # where, and why (trainer.decode_in=auto)
        deadline = time.monotonic() + 60
        while ray_train_workers(head.pid):  # torn down with the job's driver
            assert time.monotonic() < deadline, "training workers outlived the stopped job"
            time.sleep(1)

        # The just-in-time checkpoint is damaged while nobody runs: the resume must fall back
        # to the one before it.
        jit_dir = Path(s["checkpoints"]["latest"].removeprefix("file://"))
        steps = [int(p.name.removeprefix("step_")) for p in jit_dir.parent.glob("step_*")]
        before = max(step for step in steps if step < jit_step)
        manifest = json.loads((jit_dir / manifest_of(os.listdir(jit_dir))).read_text())
        model = jit_dir / manifest["files"]["model.pt"]["object"]
        model.write_bytes(model.read_bytes()[:100])
        # The resumed run (its printed command, trainer.epochs cut to what the test needs)
        # stops a worker at a progress line (every 10 steps) past the worker SIGTERM's restart
        # (sent at the first progress line after the resume) and the new attempt's settling
        # steps, so its timeouts are learned; mid-epoch; 16 steps or more before the end.
        hang_at = (before + 28 + 9) // 10 * 10
        hang_at += 10 if hang_at % 22 == 0 else 0
        epochs = (hang_at + 16) // 22 + 1
        program, args = shlex.split(command)[:3], shlex.split(command)[3:]
        assert program == ["python", "-m", "ftjob"], command
        resume = [
            f"trainer.epochs={epochs}" if arg.startswith("trainer.epochs=") else arg for arg in args
        ]
        # The drivers find `ray start`'s token, and join this cluster, whatever else runs here.
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        run_dir = tmp_path / "resumed"
        hang = ["chaos=hang", f"chaos.at_steps=[{hang_at}]"]
        resumed = start_ftjob([*resume, *hang], run_dir, tmp_path)
        second = None
        lines: list[str] = []
        try:
            read_until(resumed, "checkpoints: ", lines, timeout=240)
            # A second driver for the same run, while the first lives: refused, naming the
            # holder (in the background: the first's console is read on meanwhile).
            second = start_ftjob(resume, tmp_path / "second", tmp_path)
            read_until(resumed, "loss", lines, timeout=300)  # a progress line: training again
            [worker, *_] = ray_train_workers(head.pid)
            os.kill(worker, signal.SIGTERM)
            refused, _ = second.communicate(timeout=240)
            out, _ = resumed.communicate(timeout=480)
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
        assert s2["audit"][0]["resumed_at"] == (before % steps_per_epoch) * 64  # none again
        assert s2["audit"][-1]["epoch"] == epochs - 1 and all(exactly_once(a) for a in s2["audit"])

        [stop] = s2["chaos"]["kills"]
        assert stop["kind"] == "hang"
        [hang] = s2["hangs"]
        assert hang["rank"] == stop["target"]["rank"] and hang["pid"] == stop["target"]["pid"]
        assert hang["heartbeats_stopped"] and hang["killed"]
        # Found by the default, learned timeouts within 30 s of the stop.
        assert hang["learned"] and hang["time"] - stop["time"] < 30.0
        assert hang["stack_source"] == "py-spy" and "ftjob/worker/loop.py" in hang["stack"]
        assert (
            hung["kind"] == "hang" and hung["recovered"] and hung["detail"]["rank"] == hang["rank"]
        )
        assert s2["metrics"][M.HANG_COUNT] == 1
        assert 0 < s2["metrics"][M.HANG_DETECTION_TIME] < 30.0
        assert "hang: rank" in console and "stack captured (py-spy)" in console
        assert "A worker died or was killed" not in console  # Ray's paragraph stays in its logs

        driver_killed_with_the_cluster_kept(resume, epochs, tmp_path, head, where, dashboard)
    except BaseException:
        kept = keep_ray_logs(temp_dir, tmp_path / "ray-logs")
        print(f"Ray's logs of the failed test: {kept}")
        raise
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # `ray start --block` and everything it started
        head.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)


def keep_ray_logs(temp_dir: str, to: Path) -> str:
    """The head's logs (the raylet's, GCS's, every worker's and the controllers') copied
    beside the run dirs, before the head's temp dir goes: what a failure that Ray decided
    (a placement group removed, a worker ended) is read from afterwards."""
    try:
        shutil.copytree(Path(temp_dir, "session_latest", "logs"), to, dirs_exist_ok=True)
    except (OSError, shutil.Error) as exc:
        return f"not kept ({exc})"
    return str(to)


def driver_killed_with_the_cluster_kept(
    resume: list[str],
    epochs: int,
    tmp_path: Path,
    head: subprocess.Popen[bytes],
    where: list[str],
    dashboard: int,
) -> None:
    """A scheduler's rerun after its driver died (``resume=auto``, the memory tier on): two
    more epochs of the finished run on Ray Data's decode tasks, durable checkpoints only at
    their ends, a progress line every step, no preemption notices (a worker SIGTERMed by Ray
    leaves at once, with no just-in-time checkpoint). The first driver is SIGKILLed at its
    first progress line past the run's newest checkpoint (its process only: the cluster and the
    holders, detached actors, live on). Its workers train on until Ray ends them (the job of a
    dead driver is marked finished and its workers are made to exit): the kill leaves nearly
    two epochs, which they cannot finish first, and whatever step they reached, the holders
    hold it. The
    same command again, submitted with ``ray job submit --working-dir`` and waited for, takes
    the dead driver's lease at once, restores the newest held snapshot -- newer than
    storage's, and no older than the step the killed driver last printed -- says which resume
    happened and why, trains every remaining sample once and succeeds, leaving the cluster
    up; the dashboard's Train view lists that run, its attempt and its workers."""
    started = time.monotonic()
    per_epoch, last = 22, epochs * 22  # the finished run's last step: its newest checkpoint
    final = (epochs + 2) * per_epoch
    command = [
        *(
            a
            for a in resume
            if not a.startswith(("resume=", "trainer.epochs=", "trainer.check", "failure.pre"))
        ),
        "resume=auto",
        f"trainer.epochs={epochs + 2}",
        # None within an epoch, only their ends (220, 242): a step count (100) would commit
        # step 200, within the dead driver's reach, and storage would hold the newest step.
        "trainer.checkpoint_every_n_steps=0",
        "trainer.log_every_n_steps=1",  # the kill lands at the first step past the checkpoint
        "trainer.validate_every_n_steps=0",  # at the epoch ends only: nothing here needs more
        "trainer.decode_in=ray",  # the image files decoded by Ray Data's tasks on the cluster
        "checkpoint.memory.enabled=true",
        # Ray ends a dead driver's workers with SIGTERM, which would be a notice: with a grace
        # long enough for a just-in-time checkpoint of this small state, storage would hold the
        # newest step and the rerun would rightly restore that. Without notices the workers
        # leave at once, as they do where the grace is shorter than the state's upload.
        "failure.preemption=false",
    ]
    killed = start_ftjob(command, tmp_path / "killed", tmp_path)
    lines: list[str] = []
    try:
        printed = last
        while printed <= last:  # a progress line past the run's newest checkpoint
            read_until(killed, " loss ", lines, timeout=300)
            progress = re.search(r" step (\d+)/\d+ loss ", lines[-1])
            printed = int(progress[1]) if progress else last
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
    finally:
        if killed.poll() is None:
            killed.kill()
    killed_at = time.monotonic()
    first = "".join(lines)
    assert f"has a committed checkpoint at step {last}" in first, first[-3000:]
    assert not (tmp_path / "killed" / "summary.json").exists()  # it died: no summary
    deadline = time.monotonic() + 120
    while ray_train_workers(head.pid):  # Ray ends a dead driver's workers
        assert time.monotonic() < deadline, "training workers outlived their killed driver"
        time.sleep(0.5)
    workers_gone = time.monotonic() - killed_at
    # What the rest relies on: the dead driver's workers, ended by Ray, did not finish the run.
    checkpoints = tmp_path / "ckpt" / "stopped" / "checkpoints"
    committed = sorted(
        int(d.name.removeprefix("step_"))
        for d in checkpoints.glob("step_*")
        if manifest_of(os.listdir(d))
    )
    # (The next checkpoint is the epoch's end, 21 steps past the kill: measured here, Ray ends
    # the workers 0.3-0.5 s after the kill, 0-3 steps on.)
    assert committed[-1] == last, (
        f"the killed driver's workers committed step {committed[-1]} in the "
        f"{workers_gone:.1f} s Ray took to end them: storage holds the newest step"
    )

    run_dir = tmp_path / "requeued"
    entry = [sys.executable, "-m", "ftjob", *command, f"hydra.run.dir={run_dir}"]
    done = submit(*where, "--submission-id", "ftjob-requeued", "--", *entry)
    console = complete_logs(dashboard, "ftjob-requeued")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + console[-3000:]
    assert dashboard_get(dashboard, "/api/jobs/ftjob-requeued")["status"] == "SUCCEEDED"
    assert head.poll() is None  # the driver only disconnected: the cluster is still up
    # Which resume, and why: the run's committed checkpoint, its held snapshots, and the
    # lease of a driver that is gone.
    assert f"resume=auto: run 'stopped' has a committed checkpoint at step {committed[-1]}" in (
        console
    ), console[-4000:]
    assert "snapshot holder(s) of this run outlived its last driver" in console, console[-4000:]
    assert "that process is gone" in console, console[-4000:]
    [restore] = [line for line in console.splitlines() if " from memory:" in line]
    restored = int(restore.split("restored step ", 1)[1].split(" ", 1)[0])
    # Newer than storage's newest, no older than the killed driver's last line, and short of
    # the run's end: the held snapshots were restored and there was training left to do.
    assert committed[-1] < restored < final and printed - restored <= 1, restore
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "succeeded" and s["failures"] == []
    assert s["metrics"][M.CHECKPOINT_MEMORY_RESTORES] == 1
    assert s["metrics"][M.TRAIN_STEPS_COMPLETED] == final
    # Every sample from the snapshot's position on, once: the restored epoch and the last.
    audits = s["audit"]
    assert audits[0]["epoch"] == restored // per_epoch
    assert audits[0]["resumed_at"] == (restored % per_epoch) * 64
    assert audits[-1]["epoch"] == epochs + 1 and all(exactly_once(a) for a in audits)
    # Decoded right by Ray Data's tasks (ten digits: chance is 0.1).
    assert s["metrics"][M.VALIDATION_ACCURACY] >= 0.8, s["metrics"][M.VALIDATION_ACCURACY]
    assert "data: rank 0 decodes in Ray Data (trainer.decode_in=ray)" in console

    # The dashboard's Train view (Ray Train's state tracking, on for ftjob's runs): the run of
    # the submitted job, its attempts (one, unless a loaded machine made Ray Train restart the
    # group: then as many as the summary counts), each with its two workers.
    job_id = dashboard_get(dashboard, "/api/jobs/ftjob-requeued")["job_id"]
    # Ray Train knows the run by its identity on the cluster: its name and its storage's key.
    label = run_identity(fsspec.filesystem("file"), str(tmp_path / "ckpt" / "stopped"), "stopped")
    [run] = [
        r
        for r in dashboard_get(dashboard, "/api/train/v2/runs/v1")["train_runs"]
        if r["name"] == label.label and r["job_id"] == job_id
    ]
    assert run["status"] == "FINISHED"
    assert len(run["attempts"]) == s["attempts"] >= 1
    for attempt in run["attempts"]:
        assert len(attempt["workers"]) == 2 and all(w["pid"] for w in attempt["workers"])
    assert run["run_settings"]["train_loop_config"]["trainer"]["epochs"] == epochs + 2
    # Figures (printed, never asserted): how long Ray took to end the dead driver's workers
    # and how far they trained meanwhile; the rerun's driver start to its first step.
    timing = s["timing"]
    print(
        f"driver kill with the cluster kept: {time.monotonic() - started:.1f} s; killed at "
        f"printed step {printed}, its workers gone {workers_gone:.1f} s later; the rerun "
        f"restored step {restored} from memory and was back to step in "
        f"{timing['first_step'] - timing['run_started']:.1f} s"
    )
