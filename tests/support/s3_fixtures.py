"""A real S3 endpoint for tests marked ``s3``: moto's server on loopback.

``FTJOB_TEST_S3_ENDPOINT`` (set by ``.ci/run``, which starts ``python -m moto.server``) is used
when present; otherwise the session starts moto's server itself on a free loopback port and
stops it (by pid) at the end. Either way the tests run with dummy AWS credentials, so they
never reach a real account.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ENDPOINT_ENV = "FTJOB_TEST_S3_ENDPOINT"
DUMMY_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "ftjob-test",
    "AWS_SECRET_ACCESS_KEY": "ftjob-test",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Credentials come from the variables above only: no profile, no instance metadata.
    "AWS_EC2_METADATA_DISABLED": "true",
}
UNSET_AWS_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_serving(url: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"moto's server exited with code {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"moto's server at {url} did not answer in {timeout:.0f}s"
                ) from None
            time.sleep(0.2)


@pytest.fixture(scope="session")
def aws_test_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in DUMMY_AWS_ENV.items():
            mp.setenv(key, value)
        for key in UNSET_AWS_ENV:
            mp.delenv(key, raising=False)
        yield


@pytest.fixture(scope="session")
def s3_endpoint(aws_test_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a running S3-compatible server."""
    given = os.environ.get(ENDPOINT_ENV)
    if given:
        wait_until_serving(given, None, timeout=10)
        yield given.rstrip("/")
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path: Path = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        try:
            wait_until_serving(url, proc, timeout=60)
        except RuntimeError as exc:
            pytest.fail(f"{exc}; its log:\n{log_path.read_text()[-2000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def new_bucket(endpoint: str) -> str:
    """A new, empty bucket on ``endpoint``: its name."""
    import boto3

    name = f"ftjob-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A new, empty bucket on the test endpoint."""
    return new_bucket(s3_endpoint)
