"""Helpers of the S3 tests: a clean s3fs cache per test, the bucket's keys, a checkpoint store."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import s3fs

from ftjob.config import RetryConfig
from ftjob.storage.checkpoint import CheckpointStore
from ftjob.storage.fs import build_filesystem

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
