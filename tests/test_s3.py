"""Checkpoint storage on a real S3 API (moto's server on loopback, see s3_fixtures.py), directly
and through a fault-injecting HTTP proxy (fault_proxy.py); one end-to-end training run (a
failure and a drain notice on a simulated cluster)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import s3fs

from ftjob import metrics as M
from ftjob.config import RetryConfig
from ftjob.reporting.summary import exactly_once
from ftjob.storage.checkpoint import MANIFEST, CheckpointStore, manifest_of
from ftjob.storage.fs import RetryingFileSystem, StorageError, build_filesystem, preflight
from ftjob.storage.lease import LeaseLost
from ftjob.storage.wrapper import innermost
from tests.fault_proxy import FaultProxy
from tests.helpers import check_loggers, manifest_in, run_ftjob, zombie_commit

pytestmark = pytest.mark.s3

FAST_RETRY = RetryConfig(max_attempts=12, initial_backoff=0.01, max_backoff=0.1)


@pytest.fixture(autouse=True)
def fresh_s3fs() -> Iterator[None]:
    # s3fs caches instances (and their listings) per option set: each test starts clean.
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def s3_keys(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    client = boto3.client("s3", endpoint_url=endpoint)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def write_checkpoint(root: Path, step: int, size: int = 256 * 1024) -> str:
    local = root / f"out_{step}"
    local.mkdir(parents=True, exist_ok=True)
    (local / "model.pt").write_bytes(os.urandom(size))
    (local / "optimizer.pt").write_bytes(os.urandom(size // 4))
    (local / "state.json").write_text(json.dumps({"step": step}))
    return str(local)


def s3_store(url: str, endpoint: str, retry: RetryConfig = FAST_RETRY) -> CheckpointStore:
    fs, path = build_filesystem(url, {"endpoint_url": endpoint}, retry)
    return CheckpointStore(fs, path)


# -- the storage layer on S3 ------------------------------------------------------------------


def test_round_trip_and_errors_name_path_and_bucket(s3_endpoint: str, s3_bucket: str) -> None:
    fs, path = build_filesystem(f"s3://{s3_bucket}/run", {"endpoint_url": s3_endpoint}, FAST_RETRY)
    preflight(fs, path)
    fs.pipe_file(f"{path}/a.bin", b"payload")
    assert fs.cat_file(f"{path}/a.bin") == b"payload"
    assert s3_keys(s3_endpoint, s3_bucket) == ["run/a.bin"]  # the probe is gone
    with pytest.raises(FileNotFoundError) as info:
        fs.cat_file(f"{path}/missing.bin")
    assert f"s3://{s3_bucket}/run/missing.bin" in str(info.value)
    assert f"bucket {s3_bucket!r}" in str(info.value)


def test_missing_bucket_fails_preflight_naming_the_bucket(s3_endpoint: str) -> None:
    fs, path = build_filesystem(
        "s3://ftjob-no-such-bucket/x", {"endpoint_url": s3_endpoint}, RetryConfig()
    )
    started = time.monotonic()
    with pytest.raises(StorageError, match="bucket 'ftjob-no-such-bucket' does not exist"):
        preflight(fs, path)
    assert time.monotonic() - started < 10  # permanent: not retried
    assert fs.snapshot_stats().kind("upload").retries == 0


def test_aws_endpoint_url_variable_reaches_s3fs(
    s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    fs, path = build_filesystem(f"s3://{s3_bucket}/env", {}, FAST_RETRY)
    fs.pipe_file(f"{path}/x", b"via AWS_ENDPOINT_URL")
    assert s3_keys(s3_endpoint, s3_bucket) == ["env/x"]


def test_a_pickled_filesystem_works_in_a_fresh_process_with_its_policy(
    s3_endpoint: str, s3_bucket: str
) -> None:
    retry = RetryConfig(max_attempts=9, initial_backoff=0.01, retry_on=["QuotaExceeded"])
    fs, path = build_filesystem(f"s3://{s3_bucket}/pickled", {"endpoint_url": s3_endpoint}, retry)
    fs.pipe_file(f"{path}/x", b"written by the driver")
    # What a Ray worker does with the filesystem it is handed.
    script = (
        "import pickle, sys\n"
        "fs = pickle.load(sys.stdin.buffer)\n"
        "s3 = fs.fs\n"
        "print(fs.policy.config.max_attempts, fs.policy.config.retry_on, s3.retries,\n"
        "      s3.config_kwargs['retries']['total_max_attempts'], s3.endpoint_url)\n"
        f"print(fs.cat_file({f'{path}/x'!r}).decode())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=pickle.dumps(fs),
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    assert out.splitlines() == [
        f"9 ['QuotaExceeded'] 1 1 {s3_endpoint}",
        "written by the driver",
    ]
    assert isinstance(fs, RetryingFileSystem) and innermost(fs).retries == 1


def test_a_bucket_deleted_under_a_running_job_is_not_recreated(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path
) -> None:
    store = s3_store(f"s3://{s3_bucket}/run", s3_endpoint)
    store.commit(write_checkpoint(tmp_path / "local", 10), 10)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for key in s3_keys(s3_endpoint, s3_bucket):
        client.delete_object(Bucket=s3_bucket, Key=key)
    client.delete_bucket(Bucket=s3_bucket)
    with pytest.raises(FileNotFoundError, match=f"bucket {s3_bucket!r}"):
        store.commit(write_checkpoint(tmp_path / "local", 20), 20)
    buckets = [b["Name"] for b in client.list_buckets()["Buckets"]]
    assert s3_bucket not in buckets


def test_listing_sees_checkpoints_written_by_another_process(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path
) -> None:
    store = s3_store(f"s3://{s3_bucket}/run", s3_endpoint)
    store.commit(write_checkpoint(tmp_path / "local", 10), 10)
    assert store.steps() == [10]
    # Another attempt's worker (another s3fs instance, here boto3) commits step 20; s3fs would
    # answer the next listing from its cache.
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for key in s3_keys(s3_endpoint, s3_bucket, "run/checkpoints/step_000000010/"):
        body = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        if "/manifest." in key:
            body = body.replace(b'"step": 10', b'"step": 20')
        client.put_object(Bucket=s3_bucket, Key=key.replace("010", "020"), Body=body)
    assert store.steps() == [20, 10]
    result = store.restore_latest(str(tmp_path / "restore"))
    assert result is not None and result.step == 20


def _key(client: Any, bucket: str, directory: str, name: str) -> str:
    """The key file ``name`` of a checkpoint is stored under (its manifest names it)."""
    key = _manifest_key(client, bucket, directory)
    if name == MANIFEST:
        return key
    manifest = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return f"{directory}/{json.loads(manifest)['files'][name]['object']}"


def _manifest_key(client: Any, bucket: str, directory: str) -> str:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{directory}/").get("Contents", [])
    return f"{directory}/{manifest_of(o['Key'].rsplit('/', 1)[-1] for o in listed)}"


def _flip_model_bytes(client: Any, bucket: str, key: str) -> None:
    data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (
            lambda c, b, d: _flip_model_bytes(c, b, _key(c, b, d, "model.pt")),
            "model.pt does not match",
        ),
        (lambda c, b, d: c.delete_object(Bucket=b, Key=_key(c, b, d, MANIFEST)), "no manifest"),
        (
            lambda c, b, d: c.put_object(
                Bucket=b, Key=_key(c, b, d, "optimizer.pt"), Body=b"short"
            ),
            "optimizer.pt has 5 bytes",
        ),
    ],
    ids=["checksum", "no-manifest", "truncated"],
)
def test_a_corrupted_latest_checkpoint_falls_back_to_the_previous_one(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path, damage: Any, reason: str
) -> None:
    store = s3_store(f"s3://{s3_bucket}/run", s3_endpoint)
    for step in (10, 20):
        store.commit(write_checkpoint(tmp_path / "local", step), step)
    damage(
        boto3.client("s3", endpoint_url=s3_endpoint), s3_bucket, "run/checkpoints/step_000000020"
    )
    result = store.restore_latest(str(tmp_path / "restore"))
    assert result is not None and result.step == 10
    assert [s["step"] for s in result.skipped] == [20] and reason in result.skipped[0]["reason"]
    assert json.loads(Path(result.local_dir, "state.json").read_text()) == {"step": 10}


@pytest.mark.parametrize(
    ("name", "neighbour"),
    [("exp[1]", "exp1"), ("exp?", "expX"), ("exp*", "exp-2"), ("exp", "exp10")],
)
def test_prune_and_quarantine_on_s3_touch_only_their_own_run(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path, name: str, neighbour: str
) -> None:
    # Tried end to end: "name='exp[1]'" checkpoint.num_to_keep=1 deleted the only committed
    # checkpoint of run exp1 beside it (s3fs's recursive rm expands glob patterns).
    other = s3_store(f"s3://{s3_bucket}/runs/{neighbour}", s3_endpoint)
    other.commit(write_checkpoint(tmp_path / "o", 10, size=1024), 10)
    store = s3_store(f"s3://{s3_bucket}/runs/{name}", s3_endpoint)
    for step in (10, 20, 30):
        store.commit(write_checkpoint(tmp_path / "s", step, size=1024), step)
    assert store.prune(keep=1) == [20, 10]
    moved = store.quarantine(30, "damaged")
    manifest = manifest_in(store.fs, moved)
    assert store.steps() == [] and store.fs.exists(
        f"{moved}/{manifest['files']['model.pt']['object']}"
    )
    assert other.restore_latest(str(tmp_path / "restore")).step == 10  # intact


def test_a_deposed_drivers_late_upload_on_s3_never_touches_the_new_holders_checkpoint(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path
) -> None:
    fs, run = build_filesystem(
        f"s3://{s3_bucket}/zombie", {"endpoint_url": s3_endpoint}, FAST_RETRY
    )
    assert isinstance(zombie_commit(fs, run, str(tmp_path)), LeaseLost)
    store = CheckpointStore(fs, run)
    assert store.committed_steps() == [10]
    result = store.restore_latest(str(tmp_path / "restore"))
    assert result is not None and result.step == 10 and result.skipped == []
    assert Path(result.local_dir, "model.pt").read_text() == "B model.pt step 10\n"


def test_checkpoints_commit_and_restore_through_a_faulty_network(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path
) -> None:
    faults = {"throttle_rate": 0.15, "drop_rate": 0.1, "truncate_rate": 0.3}
    with FaultProxy(s3_endpoint, seed=11, **faults) as proxy:
        store = s3_store(f"s3://{s3_bucket}/flaky", proxy.url)
        for step in (10, 20, 30):
            store.commit(write_checkpoint(tmp_path / "local", step), step)
        result = store.restore_latest(str(tmp_path / "restore"))
        for step in (10, 20):  # more reads, verified against their manifests
            store.download(step, str(tmp_path / "older" / str(step)))
        served = proxy.snapshot()
    assert result is not None and result.step == 30 and result.skipped == []
    stats = store.fs.snapshot_stats()
    assert stats.kind("upload").failures == 0 and stats.kind("upload").retries > 0
    assert stats.kind("download").failures == 0 and stats.kind("download").retries > 0
    assert all(served[kind] > 0 for kind in ("throttle", "drop", "truncate")), served
    # What arrived is what was sent: each checkpoint verified straight from moto.
    direct = s3_store(f"s3://{s3_bucket}/flaky", s3_endpoint)
    for step in (10, 20, 30):
        direct.download(step, str(tmp_path / "verify" / str(step)))


# -- end to end -------------------------------------------------------------------------------


def test_missing_bucket_stops_the_cli_before_ray_starts(s3_endpoint: str, tmp_path: Path) -> None:
    started = time.monotonic()
    proc, _ = run_ftjob(
        ["+experiment=digits_ft", "checkpoint.storage_path=s3://ftjob-no-such-bucket/runs"],
        tmp_path,
        timeout=120,
        env={"AWS_ENDPOINT_URL": s3_endpoint},
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 2
    assert "bucket 'ftjob-no-such-bucket' does not exist" in proc.stderr
    assert "checkpoint.storage_path='s3://ftjob-no-such-bucket/runs'" in proc.stderr
    assert elapsed < 60, f"took {elapsed:.0f}s"


@pytest.mark.ray
def test_training_on_s3_through_faults_a_failure_and_a_drain_notice(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run on a simulated 3-node cluster, checkpoints on S3 through a network that
    throttles and drops: a failure restored from S3; a node drained with notice (Ray's drain
    API, as a spot reclaim) during an upload, whose checkpoint becomes the just-in-time one (no
    step lost, no failure budget spent); every checkpoint committed; no secret (in
    storage_options, or from the environment) in anything the run wrote; every logger's record
    of the run (one point per step across the restores), read back; each sample trained once."""
    # About a third of the requests fail (truncation hits only reads): every one of the run's
    # ~15 uploads goes through the proxy, so none retried would be a 1-in-600 run (0.65^15).
    faults = {"throttle_rate": 0.2, "drop_rate": 0.15, "truncate_rate": 0.06}
    secret, from_env = "s3-secret-6f1c9d2a", "env-token-0b7e44c1"
    with FaultProxy(s3_endpoint, seed=3, **faults) as proxy:
        proc, summary = run_ftjob(
            [
                "+experiment=digits_ft",
                "trainer.epochs=2",  # 22 steps an epoch: checkpoints at 22, 30, 44
                "trainer.checkpoint_every_n_steps=30",
                "trainer.audit_samples=true",
                "chaos.fail_at_steps=[25]",
                "failure.max_failures=1",  # the failure's; the notice must not need one
                # The notice comes while step 30's checkpoint uploads: every upload request
                # takes 1 s more (5 files), longer than a notice takes to arrive (the killer's
                # poll, then the drain relay's, ~1.5 s). The ranks hear it once that upload is
                # committed (6+ s through a third of requests failing, and a busy machine):
                # its 30 s give the commit room to end well before the node goes.
                "ray.local_nodes=3",
                # The drained node's replacement is added as it goes (at the deadline, not 5 s
                # later): the restart waits for it, and nothing here is about that wait.
                "ray.replace_delay=0",
                "trainer.decode_in=ray",  # Ray Data's decode through a failure and a drain
                "chaos=preempt",
                "chaos.at_steps=[30]",
                "chaos.notice=30",
                "chaos.storage.upload_delay=1.0",
                f"checkpoint.storage_path=s3://{s3_bucket}/runs",
                f"+checkpoint.storage_options.endpoint_url={proxy.url}",
                "checkpoint.retry.max_attempts=12",
                "checkpoint.retry.initial_backoff=0.05",
                "checkpoint.retry.max_backoff=0.5",
                "name=s3-e2e",
                "+checkpoint.storage_options.key=AKIAIOSFODNN7EXAMPLE",
                f"+checkpoint.storage_options.secret={secret}",
                "+ray.runtime_env.env_vars.FTJOB_TEST_TOKEN=${oc.env:FTJOB_SECRET_FROM_ENV}",
                "logger=many",
            ],
            tmp_path,
            timeout=600,
            env={"FTJOB_SECRET_FROM_ENV": from_env, "WANDB_MODE": "offline"},
        )
        served = proxy.snapshot()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert summary is not None and summary["status"] == "succeeded", summary and summary["error"]
    metrics = summary["metrics"]
    assert metrics["checkpoint/upload_failures"] == 0
    assert metrics["checkpoint/upload_retries"] > 0
    assert summary["checkpoints"]["committed"] == 3 and summary["checkpoints"]["failed"] == 0
    assert served["throttle"] > 0 and served["drop"] > 0, served
    failure, preemption = summary["failures"]
    # The failure at step 25 was recovered from the checkpoint of step 22, read from S3.
    assert failure["recovered"] and failure["restored_step"] == 22
    assert failure["download_s"] > 0
    assert failure["checkpoint"] == f"{s3_bucket}/runs/s3-e2e/checkpoints/step_000000022"
    # The drain notice came during the upload of step 30: that upload became the JIT one.
    assert preemption["kind"] == "preemption" and preemption["recovered"]
    notice = preemption["notice"]
    assert notice["source"] == "drain" and notice["step"] == 30
    assert notice["deadline"] > notice["received"] and preemption["time"] == notice["deadline"]
    assert preemption["lost_steps"] == 0 and preemption["jit"]["reused"]
    assert preemption["restored_step"] == preemption["jit"]["step"] == 30
    assert preemption["time_to_recover_s"] > 0
    assert (metrics[M.PREEMPTION_COUNT], metrics[M.FAILURES_COUNT]) == (1, 1)
    assert metrics[M.PREEMPTION_LOST_STEPS] == 0 and metrics[M.PREEMPTION_JIT_CHECKPOINT_TIME] > 0
    # The node went; it may still await Ray's death notice when the run ends.
    [drained] = summary["chaos"]["kills"] + summary["chaos"]["skipped"]
    assert drained["kind"] == "preempt"
    assert drained.get("confirmed") or "before the run ended" in drained["reason"]
    assert "preemption notice (drain)" in proc.stdout
    assert len(summary["audit"]) == 2 and all(exactly_once(a) for a in summary["audit"])
    # The bucket holds the newest committed checkpoints (checkpoint.num_to_keep=2), complete.
    keys = s3_keys(s3_endpoint, s3_bucket, "runs/s3-e2e/checkpoints/")
    kept = sorted({k.split("/")[3] for k in keys})
    assert kept == ["step_000000030", "step_000000044"]
    direct = s3_store(f"s3://{s3_bucket}/runs/s3-e2e", s3_endpoint)
    for step in (30, 44):
        assert direct.download(step, str(tmp_path / "verify" / str(step)))["step"] == step
    # Secrets: in nothing under the run dir (summary, .hydra/, loggers), the checkpoint dir,
    # or the console.
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    stored = [
        client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        for key in s3_keys(s3_endpoint, s3_bucket, "runs/")
    ]
    written = [p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len(stored) > 5 and len(written) > 5
    for value in (secret, from_env):
        assert not any(value.encode() in blob for blob in stored + written), value
        assert value not in proc.stdout + proc.stderr
    assert summary["config"]["checkpoint"]["storage_options"]["secret"] == "<redacted>"
    check_loggers(tmp_path / "run", "s3-e2e", monkeypatch, last_step=44, epochs=2, failures=1)
