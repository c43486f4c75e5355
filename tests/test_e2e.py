"""End-to-end runs on a real Ray: an existing cluster started with `ray start --head`, and a
GPU job on a cluster without GPUs. (Restores, mid-epoch resumption, exact-once and
resume=true are tested in-process: test_worker_local.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftjob import metrics as M
from tests.helpers import make_image_tree, run_ftjob

pytestmark = pytest.mark.ray


def test_gpu_job_on_a_cluster_without_gpus_stops_pointing_to_use_gpu_false(tmp_path):
    images = make_image_tree(tmp_path / "images", classes=2, train_per_class=4, val_per_class=2)
    args = [
        "+experiment=imagenet_ft",
        f"dataset.path={images}",
        "dataset.num_classes=null",
        "chaos=disabled",
        "ray.address=null",
        "trainer.num_workers=2",
        "trainer.batch_size=2",
    ]
    proc, s = run_ftjob(args, tmp_path, timeout=120)
    assert proc.returncode == 2 and s is None
    assert "trainer.use_gpu=false" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_existing_cluster_started_with_ray_start_cli(tmp_path):
    port = _free_port()
    ray_cli = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=4",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--block",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        address = f"{socket.gethostbyname(socket.gethostname())}:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if (
                    probe.connect_ex(("127.0.0.1", port)) == 0
                    or probe.connect_ex((address.split(":")[0], port)) == 0
                ):
                    break
            time.sleep(0.5)
        # Real image files, read and decoded by Ray Data on the cluster's workers.
        images = make_image_tree(tmp_path / "images")
        job = [
            "dataset=imagefolder",
            f"dataset.path={images}",
            "dataset.image_size=16",
            "dataset.resize_size=18",
            "trainer.epochs=3",
            "trainer.batch_size=8",
            "trainer.lr=0.01",
            f"ray.address=127.0.0.1:{port}",
            # One machine: every node of this cluster mounts the same disk.
            f"checkpoint.storage_path={tmp_path / 'ckpt'}",
            "checkpoint.shared_filesystem=true",
        ]
        proc, s = run_ftjob(job, tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert s["status"] == "succeeded"
        assert s["metrics"][M.TRAIN_STEPS_COMPLETED] == 3 * (72 // 16)
        assert s["metrics"][M.VALIDATION_ACCURACY] >= 0.9  # three colours: easy, if decoded right
        # The driver only disconnected: the cluster it joined is still up.
        assert head.poll() is None
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # `ray start --block` and everything it started
        head.wait(timeout=30)
