"""End-to-end runs on a real local Ray: restore, mid-epoch resume, exact-once, resume=true,
an existing cluster started with `ray start --head`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ftjob import metrics as M
from tests.conftest import make_image_tree, run_ftjob

pytestmark = pytest.mark.ray

QUICK = ["+experiment=digits_ft", "trainer.epochs=4"]


def test_forced_failures_restore_mid_epoch_and_train_every_sample_once(tmp_path, monkeypatch):
    # Step 25 fails mid-epoch (last checkpoint: 22, the end of epoch 1); step 41 fails right
    # after the checkpoint of step 40. Every logger writes the run.
    proc, s = run_ftjob(
        [*QUICK, "chaos.fail_at_steps=[25,41]", "trainer.audit_samples=true", "logger=many"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert s["status"] == "succeeded" and s["error"] is None
    m = s["metrics"]
    assert set(M.METRIC_KEYS) <= set(m)
    assert m[M.VALIDATION_ACCURACY] >= 0.85
    assert m[M.TRAIN_STEPS_COMPLETED] == 4 * 22
    assert m[M.FAILURES_COUNT] == 2
    assert m[M.CHECKPOINT_DOWNLOAD] > 0 and m[M.CHECKPOINT_LOAD] > 0
    for f in s["failures"]:  # each restore measured in its parts; skipping reads no data
        assert f["download_s"] > 0 and f["load_s"] > 0 and 0 <= f["skip_s"] < 1.0
    assert m[M.RECOVERY_TIME_TO_RECOVER] > 0
    first, second = s["failures"]
    assert (first["kind"], first["restored_step"], first["lost_steps"]) == ("injected", 22, 3)
    assert (second["restored_step"], second["lost_steps"]) == (40, 1)
    assert all(f["recovered"] and f["time_to_recover_s"] > 0 for f in s["failures"])
    # Validation results after a restore replace the lost attempt's, never duplicate them.
    steps = [v["step"] for v in s["validation"]]
    assert steps == sorted(set(steps)) and 40 in steps and steps[-1] == 88
    assert [a["epoch"] for a in s["audit"]] == [0, 1, 2, 3]
    assert all(
        a["duplicates"] == 0 and a["missing"] == 0 and a["unique"] == 1408 for a in s["audit"]
    )
    assert "failure 1: injected" in proc.stdout
    check_loggers(tmp_path / "run", s["name"], monkeypatch)


def check_loggers(run_dir: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the loggers wrote, read back with TensorBoard's and MLflow's own readers: one
    point per logged step across the restores, params, and the failures as events."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = (run_dir / "logs" / "tensorboard" / name).glob("events.*")
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 88, steps
    assert [e.step for e in acc.Scalars("validation/accuracy")][-1] == 88
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{run_dir / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name("ftjob").experiment_id])
    assert run.info.run_name == name and run.info.status == "FINISHED"
    assert run.data.params["trainer.epochs"] == "4"
    history = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(history) == steps
    noticed = [v for k, v in run.data.tags.items() if k.startswith("event.") and "failure" in v]
    assert len(noticed) >= 2
    assert (run_dir / "logs" / "metrics.csv").stat().st_size > 0


def test_resume_by_name_with_fewer_workers_continues_exactly(tmp_path):
    storage = tmp_path / "store"
    common = [
        "+experiment=digits_ft",
        "trainer.epochs=2",
        "name=shared",
        f"checkpoint.storage_path={storage}",
    ]
    first, s1 = run_ftjob(
        [*common, "chaos.fail_at_steps=[17]", "failure.max_failures=0"], tmp_path / "a"
    )
    assert first.returncode == 1 and s1["status"] == "failed"
    assert "failure.max_failures=0" in s1["error"]
    # A new run with the same name must not silently continue it...
    again, _ = run_ftjob(common, tmp_path / "b")
    assert again.returncode == 2 and "resume=true" in again.stderr
    # ...nor resume with a config that breaks the checkpoint (the diff is shown, Ray never starts).
    changed, _ = run_ftjob([*common, "resume=true", "model=resnet18"], tmp_path / "c")
    assert (
        changed.returncode == 2
        and "model._target_" in changed.stderr
        and "resnet18" in changed.stderr
    )
    # Same global batch (1 x 64 instead of 2 x 32): resumes right after sample 10 x 64.
    # Three drivers are started for it at once (a user, a restarted scheduler...): exactly
    # one trains, the others are refused before Ray starts.
    resume = [
        *common,
        "resume=true",
        "trainer.num_workers=1",
        "trainer.batch_size=64",
        "trainer.audit_samples=true",
    ]
    with ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(lambda d: run_ftjob(resume, tmp_path / d), ("d1", "d2", "d3")))
    [(resumed, s2)] = [r for r in runs if r[0].returncode != 2]
    refused = [proc for proc, _ in runs if proc.returncode == 2]
    assert len(refused) == 2
    for proc in refused:
        assert "run 'shared'" in proc.stderr and "another driver" in proc.stderr, proc.stderr
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert s2["status"] == "succeeded"
    epoch0, epoch1 = s2["audit"]
    assert epoch0["duplicates"] == 0 and epoch0["unexpected"] == 0
    # The first 10 x 64 samples of epoch 0 were trained by the first run: not expected again.
    assert epoch0["resumed_at"] == 10 * 64
    assert epoch0["unique"] == 12 * 64 and epoch0["missing"] == 0
    assert epoch1["unique"] == 1408 and epoch1["missing"] == 0 and epoch1["duplicates"] == 0


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
