"""Checkpoint storage on a real S3 API (moto's server on loopback, tests/support/s3_fixtures.py),
directly and through a fault-injecting HTTP proxy (tests/support/fault_proxy.py)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest

from ftjob.config import RetryConfig
from ftjob.storage.checkpoint import MANIFEST, CheckpointStore, manifest_of
from ftjob.storage.fs import RetryingFileSystem, StorageError, build_filesystem, preflight
from ftjob.storage.lease import LeaseLost
from ftjob.storage.wrapper import innermost
from tests.support.checkpoints import manifest_in, zombie_commit
from tests.support.fault_proxy import FaultProxy
from tests.support.processes import ray_temp_dir, run_ftjob
from tests.support.s3 import (
    FAST_RETRY,
    fresh_s3fs,  # noqa: F401 -- autouse: a clean s3fs cache per test
    s3_keys,
    s3_store,
    write_checkpoint,
)

pytestmark = pytest.mark.s3


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
    with pytest.raises(StorageError, match="bucket 'ftjob-no-such-bucket' does not exist"):
        preflight(fs, path)
    assert fs.snapshot_stats().kind("upload").retries == 0  # permanent: not retried


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
        moved = key.replace("/step_000000010/", "/step_000000020/")  # names within: as written
        client.put_object(Bucket=s3_bucket, Key=moved, Body=body)
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


def test_missing_bucket_stops_the_cli_before_ray_starts(s3_endpoint: str, tmp_path: Path) -> None:
    ray_env, ray_started = ray_temp_dir(tmp_path)
    proc, _ = run_ftjob(
        ["+experiment=digits_ft", "checkpoint.storage_path=s3://ftjob-no-such-bucket/runs"],
        tmp_path,
        timeout=120,
        env={"AWS_ENDPOINT_URL": s3_endpoint, **ray_env},
    )
    assert proc.returncode == 2
    assert "bucket 'ftjob-no-such-bucket' does not exist" in proc.stderr
    assert "checkpoint.storage_path='s3://ftjob-no-such-bucket/runs'" in proc.stderr
    assert not ray_started.exists()  # refused before Ray started
