"""End-to-end runs on a real Ray: jobs submitted to, stopped on and shown by an existing
cluster started with `ray start --head` (the cluster extra: dashboard and job server).
(Restores, mid-epoch resumption, exact-once and
resume=true are tested in-process: test_worker_local.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ftjob import metrics as M
from tests.helpers import make_image_tree

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
    later")."""
    deadline = time.monotonic() + 90
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


def head_node(port: int, dashboard: int) -> subprocess.Popen[bytes]:
    """`ray start --head --block` with its dashboard and job server on loopback, in a process
    group of its own (ended by the caller, by pid); returns once the dashboard answers."""
    ray = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [
            ray,
            "start",
            "--head",
            f"--port={port}",
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


def ray_train_workers() -> list[int]:
    """Live Ray Train worker processes on this machine."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"RayTrainWorker" in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_ray_jobs_on_a_head_started_with_ray_start_run_stop_and_show_on_the_dashboard(tmp_path):
    """As on a user's cluster: `ray start --head` with its dashboard and job server;
    `ray job submit --working-dir` runs a job on real image files, decoded by Ray Data on the
    cluster, that succeeds and leaves the cluster up; the dashboard's Train view lists the run,
    its attempt and its workers; `ray job stop` on a second job is a preemption notice: a
    just-in-time checkpoint, status preempted, the resume command (printed, and in the
    summary), no training worker left."""
    port, dashboard = _free_port(), _free_port()
    address = f"http://127.0.0.1:{dashboard}"
    head = head_node(port, dashboard)
    try:
        working_dir = tmp_path / "wd"
        working_dir.mkdir()
        (working_dir / "NOTES").write_text("the job's working dir, shipped by ray job submit\n")
        images = make_image_tree(tmp_path / "images")
        storage = [
            f"checkpoint.storage_path={tmp_path / 'ckpt'}",
            "checkpoint.shared_filesystem=true",
        ]
        job = [
            "dataset=imagefolder",
            f"dataset.path={images}",
            "dataset.image_size=16",
            "dataset.resize_size=18",
            "trainer.epochs=3",
            "trainer.decode_in=ray",  # auto would decode in the workers on a 2-core machine
            "trainer.batch_size=8",
            "trainer.lr=0.01",
            "ray.address=auto",  # the cluster the job's driver runs on
            *storage,  # one machine: every node of this cluster mounts the same disk
            "name=images",
        ]
        entry = [sys.executable, "-m", "ftjob", *job, f"hydra.run.dir={tmp_path / 'run1'}"]
        where = ["--address", address, "--working-dir", str(working_dir)]
        done = submit(*where, "--submission-id", "ftjob-images", "--", *entry)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        s = json.loads((tmp_path / "run1" / "summary.json").read_text())
        assert s["status"] == "succeeded"
        assert s["metrics"][M.TRAIN_STEPS_COMPLETED] == 3 * (72 // 16)
        assert s["metrics"][M.VALIDATION_ACCURACY] >= 0.9  # three colours: easy, if decoded right
        assert head.poll() is None  # the driver only disconnected: the cluster is still up
        # The dashboard's Train view (Ray Train's state tracking, on for ftjob's runs).
        [run] = [
            r
            for r in dashboard_get(dashboard, "/api/train/v2/runs/v1")["train_runs"]
            if r["name"] == "images"
        ]
        assert run["status"] == "FINISHED" and run["job_id"]
        [attempt] = run["attempts"]
        assert len(attempt["workers"]) == 2 and all(w["pid"] for w in attempt["workers"])
        assert run["run_settings"]["train_loop_config"]["trainer"]["epochs"] == 3

        # A second job, stopped with `ray job stop` once it committed a checkpoint.
        long = ["+experiment=digits_ft", "trainer.epochs=30", "ray.address=auto", *storage]
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
        s = json.loads((tmp_path / "run2" / "summary.json").read_text())
        assert s["status"] == "preempted", s["error"]
        assert "after a just-in-time checkpoint of step" in s["error"]
        jit_step = int(s["error"].rsplit(" ", 1)[-1])
        assert jit_step >= 10 and s["checkpoints"]["latest"].endswith(f"step_{jit_step:09d}")
        command = s["resume_command"]
        assert "resume=true" in command and "name=stopped" in command
        assert "trainer.epochs=30" in command and "ray.address=auto" in command
        assert s["metrics"][M.PREEMPTION_COUNT] == 1
        deadline = time.monotonic() + 30  # the job's last lines reach the dashboard after it
        while "to continue from" not in job_logs(dashboard, "ftjob-stopped"):
            assert time.monotonic() < deadline, "the stopped job never printed its resume command"
            time.sleep(1)
        deadline = time.monotonic() + 60
        while ray_train_workers():  # torn down with the job's driver
            assert time.monotonic() < deadline, "training workers outlived the stopped job"
            time.sleep(1)
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # `ray start --block` and everything it started
        head.wait(timeout=30)
