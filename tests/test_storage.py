"""The retry policy and the retrying filesystem, without Ray, network or sleeping: sleep, clock
and jitter are injected, failures are scripted."""

from __future__ import annotations

import errno
import gc
import http.client
import logging
import os
import pickle
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import botocore.exceptions as boto
import google.auth.exceptions as google_auth
import pyarrow.fs
import pytest
import requests
import yarl
from aiohttp.client_reqrep import RequestInfo
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from multidict import CIMultiDict, CIMultiDictProxy
from s3fs.errors import translate_boto_error

from ftjob.config import ConfigError, RetryConfig, StorageChaosConfig
from ftjob.storage.errors import ErrorClassifier, is_storage_error
from ftjob.storage.faults import INJECTED_ERRORS, FaultInjectingFileSystem
from ftjob.storage.fs import (
    RetryingFileSystem,
    StorageError,
    build_filesystem,
    preflight,
    split_options,
    to_pyarrow,
)
from ftjob.storage.retry import OpStats, RetryPolicy, StorageStats
from ftjob.storage.wrapper import DelegatingFileSystem, exclusive_create_guarantee, innermost

S3_TARGET = "s3://ckpt-bucket/runs/exp1/checkpoints/step_000000010/model.pt"


class FakeTime:
    """Clock and sleep for the policy: sleeping advances the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def policy(fake: FakeTime, seed: int = 0, **overrides: Any) -> RetryPolicy:
    config = {"initial_backoff": 0.5, "multiplier": 2.0, "max_backoff": 20.0, "jitter": 0.0}
    config.update(overrides)
    return RetryPolicy(
        RetryConfig(**config), sleep=fake.sleep, clock=fake.clock, rng=random.Random(seed)
    )


def failing(errors: list[BaseException], result: Any = "ok") -> Callable[[], Any]:
    """A call that raises ``errors`` in turn, then returns ``result``."""
    queue = list(errors)

    def fn() -> Any:
        if queue:
            raise queue.pop(0)
        return result

    return fn


def client_error(code: str, message: str, status: int) -> boto.ClientError:
    response = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {}}
    response["ResponseMetadata"]["HTTPStatusCode"] = status
    return boto.ClientError(response, "PutObject")


# -- classification ---------------------------------------------------------------------------

TRANSIENT = {
    # What s3fs raises for S3's answers (translate_boto_error is the function s3fs uses).
    "SlowDown 503": translate_boto_error(
        client_error("SlowDown", "Please reduce your request rate.", 503)
    ),
    "503 without a body": translate_boto_error(client_error("503", "Service Unavailable", 503)),
    "ServiceUnavailable": translate_boto_error(
        client_error("ServiceUnavailable", "Reduce your request rate.", 503)
    ),
    "InternalError 500": translate_boto_error(
        client_error("InternalError", "We encountered an internal error.", 500)
    ),
    "500 without a body": translate_boto_error(client_error("500", "Internal Server Error", 500)),
    "RequestTimeout": translate_boto_error(
        client_error("RequestTimeout", "Your socket connection to the server was not read", 400)
    ),
    "429 Throttling": translate_boto_error(client_error("Throttling", "Rate exceeded", 429)),
    "connection reset": ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    "connection refused": ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
    "connection aborted": ConnectionAbortedError(errno.ECONNABORTED, "Software caused abort"),
    "read timed out": TimeoutError("The read operation timed out"),
    "botocore closed": boto.ConnectionClosedError(endpoint_url="http://s3"),
    "botocore unreachable": boto.EndpointConnectionError(endpoint_url="http://s3"),
    "botocore connect timeout": boto.ConnectTimeoutError(endpoint_url="http://s3"),
    "botocore read timeout": boto.ReadTimeoutError(endpoint_url="http://s3"),
    "botocore truncated": boto.IncompleteReadError(actual_bytes=10, expected_bytes=20),
    "aiohttp disconnected": aiohttp.ServerDisconnectedError(),
    "aiohttp truncated": aiohttp.ClientPayloadError("Response payload is not completed"),
    "http.client truncated": http.client.IncompleteRead(b"partial", 100),
}

PERMANENT = {
    "AccessDenied": translate_boto_error(client_error("AccessDenied", "Access Denied", 403)),
    "403 without a body": translate_boto_error(client_error("403", "Forbidden", 403)),
    "NoSuchBucket": translate_boto_error(
        client_error("NoSuchBucket", "The specified bucket does not exist", 404)
    ),
    "InvalidAccessKeyId": translate_boto_error(
        client_error("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist", 403)
    ),
    "SignatureDoesNotMatch": translate_boto_error(
        client_error("SignatureDoesNotMatch", "The request signature we calculated", 403)
    ),
    "ExpiredToken": translate_boto_error(client_error("ExpiredToken", "token expired", 400)),
    "no credentials": boto.NoCredentialsError(),
    "missing file": FileNotFoundError(errno.ENOENT, "No such file or directory"),
    "path is a directory": IsADirectoryError(errno.EISDIR, "Is a directory"),
    "bad path": NotADirectoryError(errno.ENOTDIR, "Not a directory"),
    "unknown error": ValueError("something nobody anticipated"),
}


@pytest.mark.parametrize("exc", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_default_transient_errors(exc: BaseException) -> None:
    assert ErrorClassifier().is_transient(exc)


@pytest.mark.parametrize("exc", PERMANENT.values(), ids=PERMANENT.keys())
def test_default_permanent_errors(exc: BaseException) -> None:
    assert not ErrorClassifier().is_transient(exc)


def test_s3fs_translations_carry_the_errnos_the_classifier_expects() -> None:
    # If s3fs changed its mapping, the errno rules would silently stop matching.
    assert TRANSIENT["SlowDown 503"].errno == errno.EBUSY
    assert TRANSIENT["InternalError 500"].errno == errno.EREMOTEIO
    assert isinstance(PERMANENT["AccessDenied"], PermissionError)
    assert isinstance(PERMANENT["NoSuchBucket"], FileNotFoundError)


def test_a_path_in_the_message_does_not_decide_the_class() -> None:
    throttled = OSError(errno.EBUSY, "SlowDown (put_file s3://b/exp-403/forbidden/model.pt)")
    assert ErrorClassifier().is_transient(throttled)
    missing = FileNotFoundError("s3://b/exp-503/timed-out/model.pt")
    assert not ErrorClassifier().is_transient(missing)
    # Message rules alone (no errno, no telling type) read the message without its paths.
    classify = ErrorClassifier().is_transient
    assert not classify(OSError("failed on s3://b/run-503-x/step_1"))
    assert classify(OSError("503 Service Unavailable on s3://b/x"))
    assert not classify(RuntimeError("cannot write /mnt/timeout-tests/x"))
    assert not classify(RuntimeError("cannot write '/mnt/my runs/timeout 500/x'"))
    assert not classify(RuntimeError("upload of ckpt-bucket/exp-500/step_1/model.pt failed"))
    assert classify(RuntimeError("Read timed out writing /mnt/forbidden/x"))
    assert classify(OSError("Service Unavailable for s3://b/access-denied-tests/x"))


def test_user_rules_match_the_message_not_its_paths() -> None:
    quota = RuntimeError("Quota exceeded on s3://b/exp-7/step_1")
    assert ErrorClassifier(retry_on=("quota",)).is_transient(quota)
    assert not ErrorClassifier(retry_on=("exp-7",)).is_transient(quota)
    reset = ConnectionResetError(errno.ECONNRESET, "reset writing /mnt/quota/step_1")
    assert ErrorClassifier(give_up_on=("quota",)).is_transient(reset)


def test_a_described_error_is_classified_by_its_message_not_ftjobs_context() -> None:
    # The error a storage call raises names its target and bucket; callers classify it again.
    fake = FakeTime()
    target = "s3://exp-500/run/checkpoints/step_000000010/model.pt"
    with pytest.raises(RuntimeError) as info:
        policy(fake).call(failing([RuntimeError("Quota exceeded")]), op="pipe_file", target=target)
    assert "bucket 'exp-500'" in str(info.value)
    assert not ErrorClassifier().is_transient(info.value)
    assert not ErrorClassifier(retry_on=("not retried",)).is_transient(info.value)


@pytest.mark.parametrize("code", ["EIO", "ESTALE", "ENOTCONN", "ETIMEDOUT"])
def test_shared_filesystem_errors_are_transient(code: str) -> None:
    # What an NFS server that went away, or a FUSE mount of a bucket, makes the OS raise.
    number = getattr(errno, code)
    error = OSError(number, os.strerror(number), "/mnt/nfs/run/checkpoints/step_1/model.pt")
    assert ErrorClassifier().is_transient(error)
    assert policy(FakeTime()).call(failing([error]), op="put_file", target="/mnt/nfs/x") == "ok"


def test_an_s3_error_s3fs_does_not_know_is_not_transient_for_its_eio() -> None:
    unknown = translate_boto_error(client_error("InvalidObjectName", "Object name is bad", 400))
    assert isinstance(unknown, OSError) and unknown.errno == errno.EIO  # s3fs's fallback
    assert not ErrorClassifier().is_transient(unknown)


def test_concurrent_conditional_writes_on_s3_are_retried() -> None:
    conflict = translate_boto_error(
        client_error(
            "ConditionalRequestConflict",
            "A conflicting conditional operation is currently in progress against this "
            "resource. Please try again.",
            409,
        )
    )
    assert ErrorClassifier().is_transient(conflict)


def test_a_failed_if_none_match_is_an_existing_file_and_not_retried() -> None:
    response = {
        "Error": {
            "Code": "PreconditionFailed",
            "Message": "At least one of the pre-conditions you specified did not hold",
            "Condition": "If-None-Match",
        },
        "ResponseMetadata": {"HTTPStatusCode": 412},
    }
    taken = translate_boto_error(boto.ClientError(response, "PutObject"))
    assert isinstance(taken, FileExistsError)
    fake = FakeTime()
    stats = OpStats()
    with pytest.raises(FileExistsError) as info:
        policy(fake).call(failing([taken]), op="pipe_file", target=S3_TARGET, stats=stats)
    assert S3_TARGET in str(info.value) and info.value.__cause__ is taken
    assert stats.attempts == 1 and fake.sleeps == []


def _response_error(cls: type, status: int, url: str, message: str = "") -> BaseException:
    request = RequestInfo(yarl.URL(url), "POST", CIMultiDictProxy(CIMultiDict()), yarl.URL(url))
    return cls(request, (), status=status, message=message)


class HttpError(Exception):
    """Shaped like gcsfs's HttpError (gcsfs is not installed): a ``code`` and a message that
    ends in it."""

    def __init__(self, code: int, message: str) -> None:
        self.code, self.message = code, f"{message}, {code}"
        super().__init__(self.message)


HTTP_STATUS = {
    # a 502 from a proxy, on a bucket whose name says "forbidden"
    "aiohttp proxy 502": (
        _response_error(
            aiohttp.ClientHttpProxyError, 502, "https://storage.googleapis.com/b/forbidden-x/o"
        ),
        True,
    ),
    "aiohttp 429": (_response_error(aiohttp.ClientResponseError, 429, "https://gcs/b/o"), True),
    "aiohttp 404 at a path saying 503": (
        _response_error(aiohttp.ClientResponseError, 404, "https://gcs/b/run-503/o"),
        False,
    ),
    "aiohttp 403": (_response_error(aiohttp.ClientResponseError, 403, "https://gcs/b/o"), False),
    "aiohttp 401": (_response_error(aiohttp.ClientResponseError, 401, "https://gcs/b/o"), False),
    "gcsfs 503": (HttpError(503, "Backend Error"), True),
    "gcsfs 429": (HttpError(429, "The rate of change requests is too high"), True),
    "gcsfs 401": (HttpError(401, "Invalid Credentials"), False),
    "gcsfs 502 (requests' ProxyError)": (requests.exceptions.ProxyError(), True),
}


@pytest.mark.parametrize(("exc", "transient"), HTTP_STATUS.values(), ids=HTTP_STATUS.keys())
def test_an_http_status_decides_by_its_number(exc: BaseException, transient: bool) -> None:
    assert ErrorClassifier().is_transient(exc) is transient
    assert is_storage_error(exc)


def test_credentials_refresh_errors_are_storage_errors_classified_by_cause() -> None:
    classify = ErrorClassifier().is_transient
    unreachable = google_auth.TransportError("Failed to connect to the token endpoint")
    assert classify(unreachable)
    revoked = google_auth.RefreshError(
        "invalid_grant: Token has been expired or revoked.", {"error": "invalid_grant"}
    )
    assert not classify(revoked)
    server = google_auth.RefreshError(
        "Failed to retrieve http://metadata.google.internal/computeMetadata/v1/instance/"
        "service-accounts/default/token from the metadata service. Status: 503 Response: b''"
    )
    assert classify(server)
    assert classify(google_auth.RefreshError("token endpoint failed", retryable=True))
    assert not classify(
        google_auth.RefreshError("invalid_grant at http://sts/timeout-tests/token: bad key")
    )
    try:
        try:
            raise google_auth.TransportError("connection aborted")
        except google_auth.TransportError as cause:
            raise google_auth.RefreshError("Unable to refresh the access token") from cause
    except google_auth.RefreshError as wrapped:
        assert classify(wrapped)
    for exc in (unreachable, revoked, google_auth.DefaultCredentialsError("no credentials")):
        assert is_storage_error(exc)  # callers that tolerate storage failures catch these
    assert not is_storage_error(ValueError("a bug"))
    # Through the policy: retried, then raised as itself, naming the target.
    fake = FakeTime()
    with pytest.raises(google_auth.TransportError, match="gave up after 3 attempts"):
        policy(fake, max_attempts=3).call(
            failing([unreachable] * 3), op="pipe_file", target="gs://b/run/x"
        )
    with pytest.raises(google_auth.RefreshError, match="not retried"):
        policy(fake).call(failing([revoked]), op="pipe_file", target="gs://b/run/x")


def test_a_transient_cause_makes_a_wrapping_error_transient() -> None:
    try:
        try:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        except ConnectionResetError as inner:
            raise RuntimeError("upload failed") from inner
    except RuntimeError as outer:
        assert ErrorClassifier().is_transient(outer)


def test_user_rules_come_before_the_defaults() -> None:
    quota = RuntimeError("Quota exceeded for bucket")
    assert not ErrorClassifier().is_transient(quota)
    assert ErrorClassifier(retry_on=("quota exceeded",)).is_transient(quota)  # message regex
    assert ErrorClassifier(retry_on=("RuntimeError",)).is_transient(quota)  # type name
    slow = TRANSIENT["SlowDown 503"]
    assert not ErrorClassifier(give_up_on=("reduce your request rate",)).is_transient(slow)
    # give_up_on wins over retry_on
    assert not ErrorClassifier(retry_on=("Quota",), give_up_on=("Quota",)).is_transient(quota)


@pytest.mark.parametrize("key", ["retry_on", "give_up_on"])
def test_an_invalid_rule_is_refused_at_startup_naming_the_key(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"checkpoint\.retry\.{key}.*\(unclosed"):
        RetryPolicy(RetryConfig(**{key: ["(unclosed"]}))


# -- backoff and stopping -----------------------------------------------------------------


def test_backoff_grows_by_the_multiplier_up_to_the_cap() -> None:
    fake = FakeTime()
    p = policy(fake, max_attempts=6, initial_backoff=1.0, multiplier=2.0, max_backoff=5.0)
    transient = [TimeoutError("timed out")] * 5
    assert p.call(failing(transient), op="put_file", target="memory://x") == "ok"
    assert fake.sleeps == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_jitter_stays_within_its_bounds_and_the_cap() -> None:
    fake = FakeTime()
    p = policy(fake, seed=7, max_attempts=9, initial_backoff=1.0, max_backoff=10.0, jitter=0.25)
    stats = OpStats()
    p.call(failing([TimeoutError()] * 8), op="cat_file", target="memory://x", stats=stats)
    bases = [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 10.0]
    assert len(fake.sleeps) == len(bases)
    for wait, base in zip(fake.sleeps, bases, strict=True):
        assert base * 0.75 <= wait <= min(10.0, base * 1.25)
    assert len(set(fake.sleeps[:4])) == 4 and fake.sleeps[:4] != bases[:4]  # jitter applied
    assert stats.retry_wait_s == pytest.approx(sum(fake.sleeps))
    # The same seed draws the same waits.
    again = FakeTime()
    policy(again, seed=7, max_attempts=9, initial_backoff=1.0, max_backoff=10.0, jitter=0.25).call(
        failing([TimeoutError()] * 8), op="cat_file", target="memory://x"
    )
    assert again.sleeps == fake.sleeps


def test_gives_up_after_max_attempts_with_the_last_error() -> None:
    fake = FakeTime()
    stats = OpStats()
    errors = [OSError(errno.EBUSY, f"Please reduce your request rate ({i})") for i in range(5)]
    with pytest.raises(OSError) as info:
        policy(fake, max_attempts=4).call(
            failing(errors), op="pipe_file", target=S3_TARGET, stats=stats
        )
    assert info.value.errno == errno.EBUSY  # same type and errno as the storage's error
    assert "(3)" in str(info.value) and "gave up after 4 attempts" in str(info.value)
    assert S3_TARGET in str(info.value) and "'ckpt-bucket'" in str(info.value)
    assert (stats.calls, stats.attempts, stats.retries, stats.failures) == (1, 4, 3, 1)
    assert len(fake.sleeps) == 3


def test_deadline_stops_before_a_wait_that_would_end_past_it() -> None:
    fake = FakeTime()
    stats = OpStats()
    p = policy(
        fake, max_attempts=100, initial_backoff=4.0, multiplier=1.0, max_backoff=4.0, deadline=10.0
    )
    with pytest.raises(TimeoutError):
        p.call(failing([TimeoutError()] * 100), op="ls", target="memory://x", stats=stats)
    assert fake.sleeps == [4.0, 4.0]  # a third wait would end at 12 s > 10 s
    assert stats.attempts == 3


def test_deadline_counts_time_spent_in_slow_attempts() -> None:
    fake = FakeTime()

    def slow_timeout() -> None:
        fake.now += 6.0
        raise TimeoutError("Read timed out")

    p = policy(
        fake, max_attempts=100, initial_backoff=1.0, multiplier=1.0, max_backoff=1.0, deadline=10.0
    )
    stats = OpStats()
    with pytest.raises(TimeoutError):
        p.call(slow_timeout, op="get_file", target="memory://x", stats=stats)
    assert stats.attempts == 2  # 6 s + 1 s wait + 6 s: the next wait would end at 14 s


def test_permanent_error_fails_at_once_naming_path_and_bucket() -> None:
    fake = FakeTime()
    stats = OpStats()
    denied = translate_boto_error(client_error("AccessDenied", "Access Denied", 403))
    with pytest.raises(PermissionError) as info:
        policy(fake).call(failing([denied]), op="put_file", target=S3_TARGET, stats=stats)
    message = str(info.value)
    assert "Access Denied" in message and S3_TARGET in message and "bucket 'ckpt-bucket'" in message
    assert "not retried" in message
    assert fake.sleeps == [] and stats.attempts == 1 and stats.failures == 1
    assert info.value.__cause__ is denied  # the original stays reachable


def test_every_retry_is_logged_once_with_op_path_attempt_error_and_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeTime()
    errors = [ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")] * 2
    with caplog.at_level(logging.WARNING, logger="ftjob.storage.retry"):
        policy(fake, max_attempts=5).call(failing(errors), op="put_file", target=S3_TARGET)
    retries = [r.getMessage() for r in caplog.records if "storage retry" in r.getMessage()]
    assert len(retries) == 2
    assert "put_file" in retries[0] and S3_TARGET in retries[0]
    assert "attempt 1/5" in retries[0] and "attempt 2/5" in retries[1]
    assert "Connection reset by peer" in retries[0] and "next try in 0.50s" in retries[0]
    assert "next try in 1.00s" in retries[1]


# -- the filesystem layer -----------------------------------------------------------------


class ScriptedFileSystem(DelegatingFileSystem):
    """Raises the scripted errors of an operation before forwarding it; records every call."""

    def __init__(self, fs: AbstractFileSystem, script: dict[str, list[BaseException]]) -> None:
        super().__init__(fs)
        self.script = {op: list(errors) for op, errors in script.items()}
        self.calls: list[tuple[str, str]] = []

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        self.calls.append((op, path))
        errors = self.script.get(op)
        if errors:
            raise errors.pop(0)
        return fn()


@pytest.fixture
def memfs() -> Iterator[MemoryFileSystem]:
    """An empty in-memory filesystem (its store is process-global: emptied, then restored)."""
    saved_store, saved_dirs = dict(MemoryFileSystem.store), list(MemoryFileSystem.pseudo_dirs)
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    try:
        yield MemoryFileSystem()
    finally:
        MemoryFileSystem.store.clear()
        MemoryFileSystem.store.update(saved_store)
        MemoryFileSystem.pseudo_dirs[:] = saved_dirs


def retrying(inner: AbstractFileSystem, fake: FakeTime, **overrides: Any) -> RetryingFileSystem:
    return RetryingFileSystem(inner, policy(fake, **overrides))


def test_stats_count_attempts_retries_failures_and_success_rate(memfs: MemoryFileSystem) -> None:
    slow = OSError(errno.EBUSY, "SlowDown")
    scripted = ScriptedFileSystem(
        memfs,
        {
            "pipe_file": [slow, slow],  # succeeds on the third attempt
            "put_file": [slow, slow, slow],  # gives up
            "cat_file": [PermissionError("AccessDenied")],  # permanent
        },
    )
    fake = FakeTime()
    fs = retrying(scripted, fake, max_attempts=3)
    fs.pipe_file("/stats/a", b"data")
    with pytest.raises(OSError):
        fs.put_file(__file__, "/stats/b")
    with pytest.raises(PermissionError):
        fs.cat_file("/stats/a")
    with pytest.raises(FileNotFoundError):
        fs.cat_file("/stats/missing")  # an answer, not a failure
    stats = fs.snapshot_stats().as_dict()
    assert stats["upload"] == {
        "calls": 2,
        "attempts": 6,
        "retries": 4,
        "failures": 1,
        "not_found": 0,
        "retry_wait_s": 3.0,  # 0.5 + 1.0 per call
        "success_rate": 0.5,
    }
    assert stats["download"]["calls"] == 2 and stats["download"]["failures"] == 1
    assert stats["download"]["not_found"] == 1 and stats["download"]["success_rate"] == 0.5
    # Round trip through the ledger's JSON form, and snapshots are copies.
    assert StorageStats.from_dict(stats).as_dict() == stats
    snapshot = fs.snapshot_stats()
    fs.pipe_file("/stats/c", b"more")
    assert snapshot.kind("upload").calls == 2


def test_every_operation_reaches_the_inner_filesystem_as_it_implements_it(
    memfs: MemoryFileSystem, tmp_path: Any
) -> None:
    scripted = ScriptedFileSystem(memfs, {})
    fs = retrying(scripted, FakeTime())
    local = tmp_path / "local.bin"
    local.write_bytes(b"local")
    fs.makedirs("/ops/dir", exist_ok=True)
    fs.mkdir("/ops/dir2")
    fs.pipe_file("/ops/dir/a", b"A")
    fs.put_file(str(local), "/ops/dir/b")
    assert fs.cat_file("/ops/dir/a") == b"A"
    fs.get_file("/ops/dir/b", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == b"local"
    assert sorted(fs.ls("/ops/dir", detail=False)) == ["/ops/dir/a", "/ops/dir/b"]
    assert fs.info("/ops/dir/a")["size"] == 1
    assert sorted(fs.find("/ops")) == ["/ops/dir/a", "/ops/dir/b"]
    fs.cp_file("/ops/dir/a", "/ops/dir/c")
    fs.copy("/ops/dir/c", "/ops/dir/d")
    fs.mv("/ops/dir/d", "/ops/dir/e")
    fs.rm_file("/ops/dir/c")
    fs.rm("/ops/dir/e")
    fs.rmdir("/ops/dir2")
    assert fs.exists("/ops/dir/a") and not fs.exists("/ops/dir/c")
    assert memfs.cat_file("/ops/dir/a") == b"A" and not memfs.exists("/ops/dir/e")
    seen = {op for op, _ in scripted.calls}
    assert seen >= {"pipe_file", "put_file", "cat_file", "get_file", "ls", "info", "mkdir"}
    assert seen >= {"makedirs", "cp_file", "rm_file", "rmdir"}
    # What the memory filesystem implements itself arrives as itself; copy and mv, which it
    # inherits from fsspec, arrive as the requests fsspec makes them of.
    assert seen >= {"find", "rm"} and not seen & {"copy", "mv"}
    assert ("cp_file", "/ops/dir/c") in scripted.calls  # the copy
    assert ("put_file", "/ops/dir/b") in scripted.calls  # the storage path, not the local one


def test_operations_take_their_paths_by_keyword(memfs: MemoryFileSystem, tmp_path: Any) -> None:
    scripted = ScriptedFileSystem(memfs, {})
    fs = retrying(scripted, FakeTime())
    local = tmp_path / "local.bin"
    local.write_bytes(b"local")
    fs.pipe_file(path="/kw/a", value=b"A")
    fs.put_file(lpath=str(local), rpath="/kw/b")
    assert fs.cat_file(path="/kw/a") == b"A"
    fs.get_file(rpath="/kw/b", lpath=str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == b"local"
    assert fs.info(path="/kw/a")["size"] == 1
    fs.copy(path1="/kw/a", path2="/kw/c")
    fs.copy(path1=["/kw/a", "/kw/b"], path2=["/kw/d", "/kw/e"])
    assert fs.cat(path="/kw/e") == b"local"
    fs.rm_file(path="/kw/c")
    assert sorted(memfs.find("/kw")) == ["/kw/a", "/kw/b", "/kw/d", "/kw/e"]
    # Each request names its storage path, however it was passed.
    assert ("put_file", "/kw/b") in scripted.calls and ("get_file", "/kw/b") in scripted.calls
    assert ("cp_file", "/kw/a") in scripted.calls and ("rm_file", "/kw/c") in scripted.calls


def test_what_the_inner_filesystem_implements_is_what_answers(tmp_path: Any) -> None:
    local = LocalFileSystem()
    fs = retrying(local, FakeTime())
    path = str(tmp_path / "run" / "lease.json")
    fs.makedirs(str(tmp_path / "run"), exist_ok=True)
    fs.pipe_file(path, b"0123456789")
    assert fs.modified(path) == local.modified(path)  # the run lease reads the store's clock
    assert fs.created(path) == local.created(path)
    assert fs.size(path) == 10 and fs.sizes([path]) == [10]
    assert fs.tail(path, 3) == b"789" and fs.head(path, 2) == b"01"
    assert fs.read_block(path, 2, 3) == b"234"
    assert fs.cat_ranges([path, path], [0, 5], [2, 7]) == [b"01", b"56"]
    assert fs.isfile(path) and fs.isdir(str(tmp_path / "run")) and fs.lexists(path)
    assert fs.du(str(tmp_path / "run")) == local.du(str(tmp_path / "run"))
    assert fs.glob(str(tmp_path / "run" / "*.json")) == [path]
    # touch(truncate=False) keeps an existing file (fsspec's generic touch refuses to)
    fs.touch(path, truncate=False)
    assert local.cat_file(path) == b"0123456789"
    assert fs.ukey(path) == local.ukey(path) and fs.checksum(path) == local.checksum(path)


class FlakyMemoryFileSystem(MemoryFileSystem):
    """Its third cp_file fails once with a reset connection; counts every cp_file."""

    cachable = False

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.copies += 1
        if self.copies == 3:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        super().cp_file(path1, path2, **kwargs)


def test_a_bulk_copy_retries_the_one_request_that_failed(memfs: MemoryFileSystem) -> None:
    for i in range(6):
        memfs.pipe_file(f"/bulk/src/f{i}", b"x")
    flaky = FlakyMemoryFileSystem()
    fs = retrying(flaky, FakeTime())
    fs.copy("/bulk/src", "/bulk/dst", recursive=True)
    assert sorted(memfs.find("/bulk/dst")) == [f"/bulk/dst/f{i}" for i in range(6)]
    # Seven requests (the directory and its six files), one of them twice: not all again.
    assert flaky.copies == 8
    assert fs.snapshot_stats().kind("other").retries == 1


def test_an_existing_file_is_not_retried_and_keeps_its_type(memfs: MemoryFileSystem) -> None:
    exists = FileExistsError(errno.EEXIST, "File exists")
    scripted = ScriptedFileSystem(memfs, {"pipe_file": [exists]})
    fake = FakeTime()
    with pytest.raises(FileExistsError) as info:
        retrying(scripted, fake).pipe_file("/x/lease/1.json", b"{}", mode="create")
    assert info.value.errno == errno.EEXIST and "/x/lease/1.json" in str(info.value)
    assert fake.sleeps == [] and len(scripted.calls) == 1


# -- exclusive create -----------------------------------------------------------------------


class RacingLocalFileSystem(LocalFileSystem):
    """Another driver creates each missing path (exclusively, and so wins it) just after it
    was checked for: a create made of a check, then a write, overwrites the winner's file."""

    cachable = False

    def __init__(self) -> None:
        super().__init__()
        self.their_wins: list[str] = []

    def exists(self, path: str, **kwargs: Any) -> bool:
        found = super().exists(path)
        if not found:
            with open(self._strip_protocol(path), "xb") as f:
                f.write(b"theirs")
            self.their_wins.append(path)
        return found


def test_exclusive_create_on_local_disk_has_one_winner_without_a_check(tmp_path: Any) -> None:
    racing = RacingLocalFileSystem()
    fs = retrying(racing, FakeTime())
    (tmp_path / "lease").mkdir()
    path = str(tmp_path / "lease" / "000000001.json")
    try:
        fs.pipe_file(path, b"ours", mode="create")
        our_wins = [path]
    except FileExistsError:
        our_wins = []
    assert len(our_wins + racing.their_wins) == 1
    winner = b"ours" if our_wins else b"theirs"
    assert (tmp_path / "lease" / "000000001.json").read_bytes() == winner
    assert sorted(p.name for p in (tmp_path / "lease").iterdir()) == ["000000001.json"]


def test_exclusive_create_without_hard_links_is_still_exclusive(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(src: str, dst: str) -> None:  # a FUSE mount of a bucket, say
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    fs = retrying(LocalFileSystem(), FakeTime())
    path = str(tmp_path / "000000001.json")
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"second", mode="create")
    assert (tmp_path / "000000001.json").read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["000000001.json"]


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_one_of_many_racing_creates_wins(
    backend: str, tmp_path: Any, memfs: MemoryFileSystem
) -> None:
    inner: AbstractFileSystem = LocalFileSystem() if backend == "local" else memfs
    root = str(tmp_path) if backend == "local" else "/race"
    inner.makedirs(root, exist_ok=True)
    fs = retrying(inner, FakeTime())
    path = f"{root}/000000001.json"
    payloads = [bytes([i]) * 1_000_000 for i in range(8)]
    start = threading.Barrier(len(payloads))
    won: list[bytes] = []

    def create(data: bytes) -> None:
        start.wait()
        try:
            fs.pipe_file(path, data, mode="create")
            won.append(data)
        except FileExistsError:
            pass

    threads = [threading.Thread(target=create, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert inner.cat_file(path) == won[0]  # whole, and the winner's
    assert inner.ls(root, detail=False) == [inner._strip_protocol(path)]  # no temporary left


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_open_for_exclusive_create(backend: str, tmp_path: Any, memfs: MemoryFileSystem) -> None:
    inner: AbstractFileSystem = LocalFileSystem() if backend == "local" else memfs
    root = str(tmp_path) if backend == "local" else "/x"
    inner.makedirs(root, exist_ok=True)
    fs = retrying(inner, FakeTime())
    with fs.open(f"{root}/new.json", "xb") as f:
        f.write(b"first")
    assert inner.cat_file(f"{root}/new.json") == b"first"
    with pytest.raises(FileExistsError):
        fs.open(f"{root}/new.json", "xb")  # refused at once, as open(path, "x") is
    with pytest.raises(FileExistsError):
        fs.open(f"{root}/new.json", "x")
    # A writer that creates the file while ours is open keeps it.
    f = fs.open(f"{root}/late.json", "xb")
    f.write(b"ours")
    inner.pipe_file(f"{root}/late.json", b"theirs")
    with pytest.raises(FileExistsError):
        f.close()
    assert inner.cat_file(f"{root}/late.json") == b"theirs"


class LostAnswerFileSystem(DelegatingFileSystem):
    """Its first pipe_file reaches the store, then the connection drops before the answer."""

    def __init__(self, fs: AbstractFileSystem) -> None:
        super().__init__(fs)
        self.lost = False

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        result = fn()
        if op == "pipe_file" and not self.lost:
            self.lost = True
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return result


def test_a_create_whose_answer_was_lost_is_ours(memfs: MemoryFileSystem) -> None:
    fs = retrying(LostAnswerFileSystem(memfs), FakeTime())
    fs.pipe_file("/lost/1.json", b'{"token": "ours"}', mode="create")  # the retry finds it
    assert memfs.cat_file("/lost/1.json") == b'{"token": "ours"}'
    # Another writer's file is not ours, retry or not.
    memfs.pipe_file("/lost/2.json", b'{"token": "theirs"}')
    with pytest.raises(FileExistsError):
        fs.pipe_file("/lost/2.json", b'{"token": "ours"}', mode="create")


class KeyValueFileSystem(AbstractFileSystem):
    """A backend without atomic create whose pipe_file ignores ``mode`` altogether."""

    protocol = "kv"
    cachable = False

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self.data[self._strip_protocol(path)] = value

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        if path not in self.data:
            raise FileNotFoundError(path)
        return {"name": path, "size": len(self.data[path]), "type": "file"}


def test_exclusive_create_guarantee_says_what_each_backend_does(
    tmp_path: Any, memfs: MemoryFileSystem
) -> None:
    assert exclusive_create_guarantee(retrying(LocalFileSystem(), FakeTime())) == (
        "atomic exclusive create (local filesystem: link)"
    )
    assert "atomic within one process" in exclusive_create_guarantee(retrying(memfs, FakeTime()))
    s3, _ = build_filesystem("s3://b/run", {"endpoint_url": "http://127.0.0.1:9"}, RetryConfig())
    assert exclusive_create_guarantee(s3) == "conditional write If-None-Match: * (s3)"
    assert "if-generation-match=0" in exclusive_create_guarantee(FakeGCSFileSystem())
    kv = KeyValueFileSystem()
    assert exclusive_create_guarantee(kv) == (
        "best effort: exists check then write (no atomic create on kv)"
    )
    # ... and the wrapper does that check, even where the backend ignores mode="create".
    fs = retrying(kv, FakeTime())
    fs.pipe_file("/a", b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file("/a", b"second", mode="create")
    assert kv.data["/a"] == b"first"


def test_write_handles_upload_on_close_with_retries(memfs: MemoryFileSystem) -> None:
    scripted = ScriptedFileSystem(memfs, {"pipe_file": [ConnectionResetError("reset")] * 2})
    fs = retrying(scripted, FakeTime())
    with fs.open("/handles/snapshot.json", "wb") as f:
        f.write(b'{"step": ')
        f.write(b"10}")
    assert memfs.cat_file("/handles/snapshot.json") == b'{"step": 10}'
    assert fs.snapshot_stats().kind("upload").attempts == 3
    with fs.open("/handles/snapshot.json", "rb") as f:
        assert f.read() == b'{"step": 10}'


def test_a_write_handle_left_by_an_exception_publishes_nothing(memfs: MemoryFileSystem) -> None:
    fs = retrying(memfs, FakeTime())
    with pytest.raises(RuntimeError):
        with fs.open("/handles/half.bin", "wb") as f:
            f.write(b"first half")
            raise RuntimeError("writer died")
    assert not memfs.exists("/handles/half.bin")


def test_a_write_handle_dropped_without_close_publishes_nothing(memfs: MemoryFileSystem) -> None:
    fs = retrying(memfs, FakeTime())
    f = fs.open("/handles/dropped.bin", "wb")
    f.write(b"half of a snapshot")
    del f
    gc.collect()
    assert not memfs.exists("/handles/dropped.bin")
    f = fs.open("/handles/closed.bin", "wb")
    f.write(b"whole")
    f.close()  # an explicit close after a complete write is what publishes
    assert memfs.cat_file("/handles/closed.bin") == b"whole"


def test_pyarrow_wrapper_round_trip_goes_through_the_policy(memfs: MemoryFileSystem) -> None:
    scripted = ScriptedFileSystem(
        memfs, {"pipe_file": [OSError(errno.EBUSY, "SlowDown")], "cat_file": [TimeoutError()]}
    )
    fs = retrying(scripted, FakeTime())
    pa = to_pyarrow(fs)
    pa.create_dir("/pa/run")
    with pa.open_output_stream("/pa/run/state.json") as out:
        out.write(b"payload")
    with pa.open_input_stream("/pa/run/state.json") as stream:
        assert stream.read() == b"payload"
    info = pa.get_file_info("/pa/run/state.json")
    assert info.type == pyarrow.fs.FileType.File and info.size == 7
    listing = pa.get_file_info(pyarrow.fs.FileSelector("/pa/run", recursive=True))
    assert [i.path for i in listing] == ["/pa/run/state.json"]
    pa.copy_file("/pa/run/state.json", "/pa/run/copy.json")
    pa.move("/pa/run/copy.json", "/pa/run/moved.json")
    pa.delete_dir("/pa/run")
    assert not memfs.exists("/pa/run/state.json")
    stats = fs.snapshot_stats()
    assert stats.kind("upload").retries == 1 and stats.kind("download").retries == 1


def test_pickling_keeps_the_policy_and_the_layers(memfs: MemoryFileSystem) -> None:
    config = RetryConfig(max_attempts=7, initial_backoff=0.1, retry_on=["QuotaExceeded"])
    fs = RetryingFileSystem(
        FaultInjectingFileSystem(memfs, 0.2, ["throttle", "reset"], seed=5), RetryPolicy(config)
    )
    fs.pipe_file("/pickle/x", b"x")
    # Ray Train pickles the pyarrow wrapper to its controller and workers.
    copy = pickle.loads(pickle.dumps(to_pyarrow(fs))).handler.fs
    assert isinstance(copy, RetryingFileSystem)
    assert copy.policy.config == config
    assert copy.policy.classifier.is_transient(RuntimeError("QuotaExceeded"))
    assert isinstance(copy.fs, FaultInjectingFileSystem)
    assert (copy.fs.failure_rate, copy.fs.errors, copy.fs.seed) == (0.2, ["throttle", "reset"], 5)
    assert copy.snapshot_stats().as_dict() == {}  # counts belong to the process that made them


class _RetryingInnerFileSystem(MemoryFileSystem):
    """Stands in for s3fs: request retries are a class attribute, not a constructor option."""

    cachable = False
    retries = 5


def test_inner_retries_survive_pickling(memfs: MemoryFileSystem) -> None:
    fs = RetryingFileSystem(_RetryingInnerFileSystem(), RetryPolicy(), inner_retries=1)
    assert innermost(fs).retries == 1
    copy = pickle.loads(pickle.dumps(fs))
    assert innermost(copy) is not innermost(fs)
    assert innermost(copy).retries == 1


def test_s3_options_switch_off_the_retries_below_ours() -> None:
    options, inner = split_options("s3", {"endpoint_url": "http://127.0.0.1:9"})
    assert inner == 1  # s3fs: one try per request
    # botocore: total_max_attempts counts tries; its max_attempts would count retries.
    assert options["config_kwargs"]["retries"]["total_max_attempts"] == 1
    assert options["endpoint_url"] == "http://127.0.0.1:9"
    assert "retries" not in options  # not an s3fs constructor argument
    # Users can turn them back on.
    own = {"retries": 4, "config_kwargs": {"retries": {"mode": "adaptive"}, "read_timeout": 5}}
    options, inner = split_options("s3", own)
    assert inner == 4
    assert options["config_kwargs"] == {"retries": {"mode": "adaptive"}, "read_timeout": 5}
    assert split_options("file", {}) == ({}, None)


def _fake_retry_request(tries: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Like gcsfs's ``retry_request(retries=...)``: the tries are fixed when the class is
    defined, and the undecorated function is ``__wrapped__``."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        def retried(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(tries):
                try:
                    return func(*args, **kwargs)
                except ConnectionResetError:
                    if attempt == tries - 1:
                        raise
            return None

        retried.__wrapped__ = func  # type: ignore[attr-defined]
        return retried

    return decorate


class FakeGCSFileSystem(AbstractFileSystem):
    """Stands in for gcsfs: requests retried 6 times by a decorator, whatever ``retries`` is."""

    protocol = ("gs", "gcs")
    cachable = False
    retries = 6
    sent = 0

    def _send(self) -> None:
        type(self).sent += 1
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    _request = _fake_retry_request(6)(_send)
    _get_file_request = _fake_retry_request(6)(_send)
    _get_file_concurrent = _fake_retry_request(6)(_send)


def test_gcs_request_retries_are_switched_off_below_ours() -> None:
    assert split_options("gs", {}) == ({}, 1)
    assert split_options("gcs", {"retries": 3, "project": "p"}) == ({"project": "p"}, 3)
    fs = RetryingFileSystem(FakeGCSFileSystem(), RetryPolicy(), inner_retries=1)
    for copy in (fs, pickle.loads(pickle.dumps(fs))):  # and on the Ray workers
        FakeGCSFileSystem.sent = 0
        with pytest.raises(ConnectionResetError):
            innermost(copy)._request()
        assert FakeGCSFileSystem.sent == 1
    FakeGCSFileSystem.sent = 0
    with pytest.raises(ConnectionResetError):
        FakeGCSFileSystem()._request()  # what gcsfs does left alone
    assert FakeGCSFileSystem.sent == 6


def test_build_filesystem_hands_options_to_s3fs() -> None:
    fs, path = build_filesystem(
        "s3://some-bucket/prefix",
        {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"},
        RetryConfig(max_attempts=3),
    )
    s3 = innermost(fs)
    assert path == "some-bucket/prefix"
    assert (s3.endpoint_url, s3.key, s3.retries) == ("http://127.0.0.1:9", "k", 1)
    assert s3.config_kwargs["retries"]["total_max_attempts"] == 1
    assert fs.policy.config.max_attempts == 3
    assert fs.unstrip_protocol(path) == "s3://some-bucket/prefix"


def test_build_filesystem_adds_fault_injection_only_when_asked(tmp_path: Any) -> None:
    plain, _ = build_filesystem(str(tmp_path), {}, RetryConfig())
    assert not isinstance(plain.fs, FaultInjectingFileSystem)
    chaos = StorageChaosConfig(failure_rate=0.3, errors=["reset"])
    faulty, path = build_filesystem(str(tmp_path), {}, RetryConfig(), chaos, seed=3)
    assert isinstance(faulty.fs, FaultInjectingFileSystem)
    assert (faulty.fs.failure_rate, faulty.fs.errors, faulty.fs.seed) == (0.3, ["reset"], 3)


def test_a_slow_store_delays_checkpoint_uploads_only(memfs: MemoryFileSystem) -> None:
    slept: list[float] = []
    slow = FaultInjectingFileSystem(memfs, 0.0, ["reset"], upload_delay=2.5, sleep=slept.append)
    slow.pipe_file("/run/checkpoints/step_000000010/model.pt", b"weights")
    slow.pipe_file("/run/checkpoint_manager_snapshot.json", b"{}")  # Ray Train's bookkeeping
    slow.cat_file("/run/checkpoints/step_000000010/model.pt")
    assert slept == [2.5]
    chaos = StorageChaosConfig(upload_delay=1.0)
    fs, _ = build_filesystem("memory://slow", {}, RetryConfig(), chaos)
    assert isinstance(fs.fs, FaultInjectingFileSystem) and fs.fs.upload_delay == 1.0


# -- fault injection ------------------------------------------------------------------------


def _pattern(seed: int, n: int = 300, rate: float = 0.3) -> list[str | None]:
    scripted = ScriptedFileSystem(MemoryFileSystem(), {})
    faulty = FaultInjectingFileSystem(scripted, rate, ["throttle", "reset", "timeout"], seed=seed)
    out: list[str | None] = []
    for _ in range(n):
        try:
            faulty.info("/")
            out.append(None)
        except Exception as exc:
            out.append(type(exc).__name__)
    return out


def test_fault_injection_is_seeded_and_hits_its_rate() -> None:
    first, again, other = _pattern(1), _pattern(1), _pattern(2)
    assert first == again
    assert first != other
    rate = sum(p is not None for p in _pattern(3, n=2000)) / 2000
    assert 0.26 <= rate <= 0.34
    assert {p for p in first if p} == {"OSError", "ConnectionResetError", "TimeoutError"}


@pytest.mark.parametrize(
    ("kind", "transient"),
    [("throttle", True), ("reset", True), ("timeout", True), ("permanent", False)],
)
def test_injected_error_kinds_classify_as_intended(kind: str, transient: bool) -> None:
    assert ErrorClassifier().is_transient(INJECTED_ERRORS[kind]("put_file /x")) is transient


def test_permanent_faults_hit_checkpoint_uploads_only_and_are_not_retried(
    memfs: MemoryFileSystem,
) -> None:
    scripted = ScriptedFileSystem(memfs, {})
    fs = retrying(FaultInjectingFileSystem(scripted, 0.5, ["permanent"], seed=0), FakeTime())
    outcomes = []
    for i in range(40):
        try:
            fs.pipe_file(f"/run/checkpoints/step_{i:09d}/model.pt", b"x")
            outcomes.append(True)
        except PermissionError:
            outcomes.append(False)
    assert 0 < outcomes.count(False) < 40
    assert len(scripted.calls) == outcomes.count(True)  # failed calls were not retried
    assert fs.snapshot_stats().kind("upload").retries == 0
    # Ray Train's own files, and reads, never get a permanent fault: it would only end the job.
    memfs.pipe_file("/run/checkpoints/step_000000099/model.pt", b"committed")
    for i in range(40):
        fs.pipe_file(f"/run/checkpoint_manager_snapshot_{i}.json", b"{}")
        assert fs.cat_file("/run/checkpoints/step_000000099/model.pt") == b"committed"
        fs.ls("/run")


def test_transient_injection_is_absorbed_by_retries(memfs: MemoryFileSystem) -> None:
    fake = FakeTime()
    fs = retrying(
        FaultInjectingFileSystem(memfs, 0.3, ["throttle", "reset", "timeout"], seed=4),
        fake,
        max_attempts=12,
    )
    for i in range(50):
        fs.pipe_file(f"/absorb/{i}", b"x")
    upload = fs.snapshot_stats().kind("upload")
    assert upload.failures == 0 and upload.retries > 0
    assert len(memfs.find("/absorb")) == 50


# -- preflight --------------------------------------------------------------------------------


def test_preflight_creates_the_local_directory_and_leaves_no_probe(tmp_path: Any) -> None:
    fs, path = build_filesystem(str(tmp_path / "new" / "checkpoints"), {}, RetryConfig())
    preflight(fs, path)
    assert (tmp_path / "new" / "checkpoints").is_dir()
    assert list((tmp_path / "new" / "checkpoints").iterdir()) == []


def test_preflight_reports_a_permission_problem_with_the_key(memfs: MemoryFileSystem) -> None:
    denied = translate_boto_error(client_error("AccessDenied", "Access Denied", 403))
    fs = retrying(ScriptedFileSystem(memfs, {"pipe_file": [denied]}), FakeTime())
    with pytest.raises(
        StorageError, match=r"checkpoint\.storage_path='memory:///pre'.*no permission.*AWS_\*"
    ):
        preflight(fs, "/pre")


def test_preflight_reports_an_unreachable_store_after_the_retries(memfs: MemoryFileSystem) -> None:
    scripted = ScriptedFileSystem(
        memfs, {"pipe_file": [boto.EndpointConnectionError(endpoint_url="http://s3")] * 3}
    )
    fake = FakeTime()
    with pytest.raises(StorageError, match=r"did not answer after all retries.*endpoint_url"):
        preflight(retrying(scripted, fake, max_attempts=3), "/unreachable")
    assert len(fake.sleeps) == 2
